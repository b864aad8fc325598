"""``load_checkpoint(a_dict, url)`` loads tensors in place, as DCP's ``load`` does."""

from __future__ import annotations

import pytest
import torch

from elastic_kit import CheckpointMismatchError, load_checkpoint, save_checkpoint


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    return model, opt


def test_a_dict_of_state_dicts_loads_into_the_model_and_optimizer_themselves(tmp_path):
    """The DCP pattern: the dict holds the live state dicts, and no load_state_dict
    follows. A dict.update would leave the model's weights as they were while the
    step came from the checkpoint."""
    saved_model, saved_opt = _trained(0)
    save_checkpoint({"model": saved_model.state_dict(), "optim": saved_opt.state_dict(),
                     "epoch": 3}, tmp_path, step=7)
    model, opt = _trained(1)  # other weights, other optimizer moments
    weight = model[0].weight
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 0}
    loaded = load_checkpoint(state, tmp_path)
    assert loaded.step == 7 and state["epoch"] == 3
    assert model[0].weight is weight  # the same Parameter, now holding the saved values
    for name, t in saved_model.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name
    exp_avg = opt.state[model[0].weight]["exp_avg"]
    assert torch.equal(exp_avg, saved_opt.state[saved_model[0].weight]["exp_avg"])
    assert state["optim"]["state"][0]["exp_avg"] is exp_avg


def test_a_parameter_in_the_dict_stays_that_parameter(tmp_path):
    save_checkpoint({"scale": torch.nn.Parameter(torch.full((2,), 5.0))}, tmp_path, step=1)
    scale = torch.nn.Parameter(torch.zeros(2))
    state = {"scale": scale}
    load_checkpoint(state, tmp_path)
    assert state["scale"] is scale and scale.requires_grad
    assert scale.tolist() == [5.0, 5.0]


def test_values_are_converted_to_the_dtype_the_dict_holds(tmp_path):
    save_checkpoint({"w": torch.tensor([1.5, 2.25], dtype=torch.float64)}, tmp_path, step=1)
    w = torch.zeros(2, dtype=torch.bfloat16)
    state = {"w": w}
    load_checkpoint(state, tmp_path)
    assert state["w"] is w and w.dtype == torch.bfloat16 and w.tolist() == [1.5, 2.25]


def test_other_values_and_new_keys_are_set_as_dict_update_would(tmp_path):
    save_checkpoint({"w": torch.ones(2), "note": "saved", "new": torch.arange(3),
                     "groups": [{"lr": 0.5}], "pair": (1, 2), "was_none": torch.ones(1)},
                    tmp_path, step=1)
    state = {"note": "fresh", "groups": [{"lr": 0.1}], "pair": (0, 0), "was_none": None,
             "kept": 4}
    load_checkpoint(state, tmp_path)
    assert state["note"] == "saved" and state["groups"] == [{"lr": 0.5}]
    assert state["pair"] == (1, 2) and state["kept"] == 4
    assert state["new"].tolist() == [0, 1, 2] and state["was_none"].tolist() == [1.0]
    assert state["w"].tolist() == [1.0, 1.0]


def test_a_shape_mismatch_names_the_path_and_loads_nothing(tmp_path):
    save_checkpoint({"a": torch.ones(2), "m": {"b": torch.ones(3)}, "epoch": 9},
                    tmp_path, step=1)
    a, b = torch.zeros(2), torch.zeros(4)
    state = {"a": a, "m": {"b": b}, "epoch": 0}
    with pytest.raises(CheckpointMismatchError, match=r"\['m'\]\['b'\].*\[3\].*\[4\]"):
        load_checkpoint(state, tmp_path)
    assert a.tolist() == [0.0, 0.0] and state["epoch"] == 0 and state["m"]["b"] is b
    assert isinstance(CheckpointMismatchError("x"), ValueError)


def test_a_meta_tensor_in_the_dict_is_replaced_not_copied_into(tmp_path):
    """A copy into a meta tensor does nothing and raises nothing: the loaded tensor
    takes its place, as before any in-place loading."""
    save_checkpoint({"w": torch.full((2,), 3.0)}, tmp_path, step=1)
    state = {"w": torch.empty(2, device="meta")}
    load_checkpoint(state, tmp_path)
    assert state["w"].device.type == "cpu" and state["w"].tolist() == [3.0, 3.0]


@pytest.mark.parametrize("saved_as", ["bare", "ddp_prefix"])
def test_a_tensor_the_checkpoint_lacks_fails_the_load_naming_it(tmp_path, saved_as):
    """Key paths that do not match would load nothing: DCP and a module's strict
    load_state_dict raise, and so does this."""
    saved, _ = _trained(0)
    sd = saved.state_dict()
    if saved_as == "ddp_prefix":
        sd = {f"module.{k}": v for k, v in sd.items()}
        save_checkpoint({"model": sd, "epoch": 3}, tmp_path, step=10)
    else:
        save_checkpoint(sd, tmp_path, step=10)
    model, _ = _trained(1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {"model": model.state_dict(), "epoch": 0}
    with pytest.raises(CheckpointMismatchError,
                       match=r"no tensor for 7 of the tensors the state holds: "
                             r"\['model'\]\['0.weight'\], \['model'\]\['0.bias'\]"):
        load_checkpoint(state, tmp_path)
    assert state["epoch"] == 0 and set(state) == {"model", "epoch"}
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_keys_the_checkpoint_lacks_that_hold_no_tensor_are_left_alone(tmp_path):
    save_checkpoint({"w": torch.ones(2)}, tmp_path, step=1)
    state = {"w": torch.zeros(2), "note": "mine", "groups": [{"lr": 0.1}]}
    load_checkpoint(state, tmp_path)
    assert state == {"w": state["w"], "note": "mine", "groups": [{"lr": 0.1}]}
    assert state["w"].tolist() == [1.0, 1.0]


@pytest.mark.parametrize("saved,held,named", [
    ({"t": [torch.ones(2)]}, lambda q: {"t": [q, torch.zeros(1)]},
     r"\['t'\]\[0\] \(the checkpoint holds a list of length 1 at \['t'\]\), \['t'\]\[1\]"),
    ({"t": 5}, lambda q: {"t": q},
     r"\['t'\] \(the checkpoint holds a value of type int at \['t'\]\)"),
    ({"t": (torch.ones(2), 1)}, lambda q: {"t": (q,)},
     r"\['t'\]\[0\] \(the checkpoint holds a tuple of length 2"),
])
def test_a_tensor_the_checkpoint_holds_another_value_for_fails_the_load(
        tmp_path, saved, held, named):
    """A tensor of the state that the load would replace instead of loading (the
    checkpoint holds a number there, or a list or tuple of another length) is one the
    checkpoint lacks: the load fails naming it, and loads nothing."""
    save_checkpoint({**saved, "epoch": 3}, tmp_path, step=1)
    q = torch.zeros(2)
    state = {**held(q), "epoch": 0}
    with pytest.raises(CheckpointMismatchError, match=named):
        load_checkpoint(state, tmp_path)
    assert q.tolist() == [0.0, 0.0] and state["epoch"] == 0


def test_tensors_in_a_tuple_of_the_same_length_are_loaded_in_place(tmp_path):
    save_checkpoint({"t": (torch.ones(2), 0.5), "u": (1, 2)}, tmp_path, step=1)
    p = torch.zeros(2)
    state = {"t": (p, 0.1), "u": (0, 0)}
    load_checkpoint(state, tmp_path)
    assert p.tolist() == [1.0, 1.0]  # the tensor the caller holds, not only the dict
    assert state["t"][0].tolist() == [1.0, 1.0] and state["t"][1] == 0.5
    assert state["u"] == (1, 2)


def test_a_tuple_keeps_the_callers_tensors_in_their_dtype(tmp_path):
    """The tuple the state holds is rebuilt from its own items, loaded in place: the
    checkpoint's tuple in its place brought the checkpoint's dtype and device."""
    save_checkpoint({"stats": (torch.full((3,), 2.0), torch.full((3,), 3.0), {"n": 5})},
                    tmp_path, step=1)
    mean, std = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    state = {"stats": (mean, std, {"n": 0})}
    load_checkpoint(state, tmp_path)
    assert state["stats"][0] is mean and state["stats"][1] is std
    assert mean.tolist() == [2.0] * 3 and std.dtype == torch.float64
    assert state["stats"][2] == {"n": 5} and type(state["stats"]) is tuple


@pytest.mark.parametrize("kind", ["expanded", "inference"])
def test_a_tensor_that_cannot_be_copied_into_is_refused_before_anything_loads(
        tmp_path, kind):
    """The copy into such a tensor failed after the tensors before it were loaded, with
    torch's error naming no key."""
    url = str(tmp_path / "ck")
    save_checkpoint({"a": torch.ones(4), "b": torch.arange(4.0)}, url, step=1)
    if kind == "expanded":
        b = torch.zeros(1).expand(4)
    else:
        with torch.inference_mode():
            b = torch.zeros(4)
    target = {"a": torch.zeros(4), "b": b}
    with pytest.raises(ValueError, match=r"state holds at \['b'\] cannot be loaded into: "
                                         r".*nothing was loaded"):
        load_checkpoint(target, url)
    assert torch.equal(target["a"], torch.zeros(4))


def test_a_module_with_another_head_is_refused_before_anything_loads(tmp_path):
    """``Module.load_state_dict`` copies the tensors that fit before it raises its
    RuntimeError: the model was left half loaded, with no ValueError to catch."""
    torch.manual_seed(0)
    url = str(tmp_path / "ck")
    save_checkpoint(torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 3)), url,
                    step=1)
    other = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointMismatchError,
                       match=r"1\.weight \[3, 4\] \(the module's: \[2, 4\]\).*nothing was loaded"):
        load_checkpoint(other, url)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())


def test_the_functions_take_every_store_option(tmp_path):
    url = str(tmp_path / "ck")
    save_checkpoint({"a": torch.ones(1)}, url, step=0, private=True)
    assert (tmp_path / "ck").stat().st_mode & 0o777 == 0o700
    assert load_checkpoint(None, url, private=True).step == 0
