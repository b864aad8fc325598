"""One configuration for the checkpointer's options: CheckpointerConfig, taken by the
Checkpointer as keyword arguments and nested in LoopConfig."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from torch import nn

import elastic_kit as ek


def test_loop_config_nests_the_checkpointer_options_with_the_loops_audit_default() -> None:
    cfg = ek.LoopConfig(global_batch_size=8,
                        checkpoint=ek.CheckpointerConfig(every_steps=5, blocking=True))
    opts = cfg.checkpointer_options()
    assert opts["every_steps"] == 5 and opts["blocking"] is True
    assert opts["audit"] == "error"  # the loop audits by default, a Checkpointer does not
    assert ek.LoopConfig(global_batch_size=8).checkpointer_options()["audit"] == "error"
    state = ek.TrainState(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1))
    plain = ek.Checkpointer(state, None, handle_signals=False, info=ek.DistInfo())
    assert plain.audit == "off"
    looped = ek.Checkpointer(state, None, **{**opts, "handle_signals": False},
                             info=ek.DistInfo())
    assert (looped.every_steps, looped.blocking, looped.audit) == (5, True, "error")


def test_the_old_flat_names_still_work_with_a_deprecation_warning_naming_the_new_ones() -> None:
    with pytest.warns(DeprecationWarning, match=r"checkpoint_every_steps, sigterm_exit_code"
                      r".*CheckpointerConfig\(every_steps, exit_code"):
        old = ek.LoopConfig(global_batch_size=8, checkpoint_every_steps=7, sigterm_exit_code=99)
    new = ek.LoopConfig(global_batch_size=8,
                        checkpoint=ek.CheckpointerConfig(every_steps=7, exit_code=99))
    assert old == new and old.checkpoint.every_steps == 7
    assert old.checkpoint_every_steps == 7 and old.sigterm_exit_code == 99  # still readable
    assert old.audit == "error"
    with pytest.warns(DeprecationWarning, match="checkpoint = dataclasses.replace"):
        old.checkpoint_every_steps = 9  # code that set the flat name keeps working
    assert old.checkpoint.every_steps == 9 and old.checkpoint.exit_code == 99


def test_replace_keeps_the_nested_options_and_warns_about_nothing() -> None:
    cfg = ek.LoopConfig(global_batch_size=8,
                        checkpoint=ek.CheckpointerConfig(every_steps=3, audit="warn"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = dataclasses.replace(cfg, epochs=4)
    assert again.epochs == 4 and again.checkpoint == cfg.checkpoint


@pytest.mark.parametrize("options, named", [
    ({"every_steps": 0}, "every_steps=0"),
    ({"every_seconds": -1}, "every_seconds=-1"),
    ({"audit": "maybe"}, "audit='maybe'"),
    ({"exit_code": 0}, "exit_code=0"),
    ({"snapshot_every": "often"}, "snapshot_every='often'"),
    ({"snapshot_budget": 2.0}, "snapshot_budget=2.0"),
    ({"keep_last": 0}, "keep_last=0"),
])
def test_one_validator_names_the_bad_value_for_both_forms(options: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        ek.CheckpointerConfig(**options)
    state = ek.TrainState(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1))
    with pytest.raises(ValueError, match=named):
        ek.Checkpointer(state, None, **options)


@pytest.mark.parametrize("store, named", [
    (123, "store=123"), (b"/tmp/x", "store=b'/tmp/x'"), (object(), "store=<object"),
])
def test_a_store_that_is_none_of_path_url_or_store_is_named(store: object, named: str) -> None:
    state = ek.TrainState(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1))
    with pytest.raises(TypeError, match=named):
        ek.Checkpointer(state, store, handle_signals=False)


def test_a_state_that_is_not_a_train_state_is_named(tmp_path) -> None:
    model = nn.Linear(2, 2)
    # named by its type: a model's (or a state dict's) repr can run to pages
    with pytest.raises(TypeError, match=r"state=<torch.nn.modules.linear.Linear object>: "
                                        r"expected an ek.TrainState"):
        ek.Checkpointer(model, str(tmp_path), handle_signals=False)  # type: ignore[arg-type]


def test_loop_config_refuses_a_checkpoint_that_is_not_a_checkpointer_config() -> None:
    with pytest.raises(TypeError, match="CheckpointerConfig"):
        ek.LoopConfig(global_batch_size=8, checkpoint={"every_steps": 5})  # type: ignore


def test_an_exchange_read_early_is_merged_into_the_next_one() -> None:
    from elastic_kit.checkpointer._cadence import Cadence, Flags
    from elastic_kit.state import TerminationFlag

    model = torch.nn.Linear(2, 2)
    state = ek.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    cadence = Cadence(state, ek.DistInfo(), TerminationFlag(), None)
    cadence._early = Flags(leave=1.0, exchange_every=5.0)
    cadence._flags = lambda: torch.tensor([0.0, 1.0, 0.0, 3.0, 0.0], dtype=torch.float64)
    assert cadence.resolve() == Flags(save_due=1.0, exchange_every=5.0, leave=1.0)
    assert cadence.resolve() == Flags()  # both read: nothing carried


def test_a_timed_save_is_asked_for_once_until_a_save_answers_it() -> None:
    """An exchange is read an exchange after it is sent, so the save it asks for comes
    after the next exchange went out: that one must not ask for a second save (every
    timed save came in pairs with more than one rank)."""
    from elastic_kit.checkpointer._cadence import Cadence, Flags
    from elastic_kit.state import TerminationFlag

    model = torch.nn.Linear(2, 2)
    state = ek.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    cadence = Cadence(state, ek.DistInfo(rank=0, world_size=2), TerminationFlag(), 60.0)
    cadence.last_save_time -= 61.0
    assert cadence.local_flags().save_due == 1.0
    assert cadence.local_flags().save_due == 0.0     # sent before the save came
    cadence._early = Flags(save_due=1.0)             # read early by an epoch's end ...
    cadence.saved()                                  # ... whose save answers it
    assert cadence.resolve().save_due == 0.0
    assert cadence.local_flags().save_due == 0.0     # the interval starts again
    cadence.last_save_time -= 61.0
    assert cadence.local_flags().save_due == 1.0


def test_a_save_made_while_a_timed_saves_exchange_is_in_flight_answers_it() -> None:
    """The exchange in flight asks for a timed save; a save (every_steps, an epoch's
    end) comes before it is read: reading it then asks for no second save."""
    from elastic_kit.checkpointer._cadence import Cadence, Flags
    from elastic_kit.state import TerminationFlag

    model = torch.nn.Linear(2, 2)
    state = ek.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    cadence = Cadence(state, ek.DistInfo(rank=0, world_size=2), TerminationFlag(), 60.0)
    cadence.last_save_time -= 61.0
    sent = cadence.local_flags()
    assert sent.save_due == 1.0
    cadence._flags = lambda: torch.tensor(sent, dtype=torch.float64)  # in flight
    cadence.saved()                                  # a step's save comes first
    got = cadence.resolve()
    assert got.save_due == 0.0
    assert got._replace(save_due=1.0) == sent        # the rest of the flags is kept
    # an exchange sent after the save is not answered by it
    cadence.last_save_time -= 61.0
    sent = cadence.local_flags()
    cadence._flags = lambda: torch.tensor(sent, dtype=torch.float64)
    assert cadence.resolve().save_due == 1.0
    assert Flags(*sent).save_due == 1.0


def test_a_drop_last_sampler_is_refused_naming_why(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The checkpointer's audit counts every sample of an epoch, and which tail a
    drop_last epoch drops would change with the world size a restart brings."""
    import pytest
    import torch

    import elastic_kit as ek

    model = torch.nn.Linear(2, 2)
    sampler = ek.ElasticDistributedSampler(range(11), num_replicas=1, rank=0, drop_last=True)
    ck = ek.Checkpointer(ek.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                       sampler=sampler),
                         str(tmp_path / "ck"), handle_signals=False, snapshot_every=0)
    with pytest.raises(ValueError, match="drop_last=True.*needs drop_last=False"):
        ck.restore()
    ck.close()
