"""The shipped FLA autotuning table (mixers/gdn/tuned.py): found, saved, seeded, and refused when it should be.

The CPU tests stand in for Triton's Autotuner / Config with objects of the same surface (`configs`, `cache`, `fn`,
`all_kwargs()`); the GPU test runs the real kernels with the seeded choices through the self-test."""

from __future__ import annotations

import json
import types

import pytest

from hybridtune.mixers.gdn import tuned

DEVICE = "NVIDIA H200"
VERSIONS = {"fla": "0.6.0", "triton": "3.6.0"}


class Config:
    def __init__(self, num_warps, num_stages=2, **kwargs):
        self.kwargs, self.num_warps, self.num_stages = kwargs, num_warps, num_stages

    def all_kwargs(self):
        return {**self.kwargs, "num_warps": self.num_warps, "num_stages": self.num_stages, "num_ctas": 1}


class Autotuner:
    def __init__(self, fn, configs):
        self.fn, self.configs, self.cache = fn, configs, {}


class Heuristics:
    def __init__(self, fn):
        self.fn = fn


def _kernel(module: str, name: str):
    def f():
        return None

    f.__module__, f.__name__ = module, name
    jit = types.SimpleNamespace(fn=f)  # triton.jit's JITFunction keeps the function as .fn
    return jit


def _modules():
    """Two FLA modules: a heuristics-wrapped autotuned kernel, a plain autotuned one, its re-export elsewhere, and a
    module outside FLA that must not be read."""
    h = Autotuner(_kernel("fla.ops.common.chunk_o", "chunk_fwd_kernel_o"), [Config(4, BV=64), Config(8, BV=128)])
    p = Autotuner(_kernel("fla.ops.utils.solve_tril", "merge_kernel"), [Config(2), Config(4), Config(4, 3)])
    other = Autotuner(_kernel("not_fla", "k"), [Config(1)])
    mods = {
        "fla.ops.common.chunk_o": types.SimpleNamespace(chunk_fwd_kernel_o=Heuristics(h), helper=len),
        "fla.ops.utils.solve_tril": types.SimpleNamespace(merge_kernel=p),
        "fla.ops.gated_delta_rule.chunk": types.SimpleNamespace(merge_kernel=p),  # a re-export: the same tuner
        "not_fla": types.SimpleNamespace(k=other),
        "fla.empty": None,
    }
    return mods, h, p


@pytest.fixture
def fixed_versions(monkeypatch):
    monkeypatch.setattr(tuned, "versions", lambda: dict(VERSIONS))


def _found():
    mods, h, p = _modules()
    return tuned.autotuners(mods, kind=Autotuner), h, p


def test_autotuners_are_found_through_wrappers_once_and_only_in_fla():
    found, h, p = _found()
    assert found == {"fla.ops.common.chunk_o.chunk_fwd_kernel_o": h, "fla.ops.utils.solve_tril.merge_kernel": p}


def test_device_slug_is_fla_spelling():
    assert tuned.device_slug("NVIDIA H200") == "NVIDIA_H200"
    assert tuned.device_slug("NVIDIA GeForce RTX 4090 (x)") == "NVIDIA_GeForce_RTX_4090_x"
    assert tuned.device_slug("---") == "unknown"


def test_save_then_seed_gives_a_fresh_process_the_same_choices(tmp_path, fixed_versions):
    found, h, p = _found()
    key_h, key_p = (16, 128, 128, 64, "torch.bfloat16"), (16, 64, True)
    h.cache[key_h], p.cache[key_p] = h.configs[1], p.configs[2]
    path = tmp_path / "NVIDIA_H200.json"
    assert tuned.save(path, DEVICE, found) == 2
    data = json.loads(path.read_text())
    assert data["format"] == tuned.FORMAT and data["device"] == DEVICE and data["versions"] == VERSIONS

    fresh, h2, p2 = _found()  # a new process: the same kernels, nothing chosen yet
    line = tuned.seed(DEVICE, path, fresh)
    assert h2.cache == {key_h: h2.configs[1]} and p2.cache == {key_p: p2.configs[2]}
    assert h2.cache[key_h] is h2.configs[1]  # the kernel's own candidate object, not one built from the file
    assert "2 FLA autotuning choices taken from NVIDIA_H200.json" in line and "of its" not in line


def test_seed_takes_only_candidates_scalars_and_never_overrides(tmp_path, fixed_versions):
    found, h, p = _found()
    chosen_before = Config(4, BV=64)
    p.cache[(1,)] = chosen_before
    entries = {
        "fla.ops.common.chunk_o.chunk_fwd_kernel_o": [
            {"key": [16, "torch.bfloat16"], "config": {"BV": 96, "num_warps": 4, "num_stages": 2, "num_ctas": 1}},
            {"key": [[16], "x"], "config": {"BV": 64, "num_warps": 4, "num_stages": 2, "num_ctas": 1}},
            {"key": [32], "config": {"BV": 64, "num_warps": 4, "num_stages": 2, "num_ctas": 1, "extra": {"a": 1}}},
            "not an entry",
        ],
        "fla.ops.utils.solve_tril.merge_kernel": [
            {"key": [1], "config": {"num_warps": 2, "num_stages": 2, "num_ctas": 1}},
            {"key": [2], "config": {"num_warps": 4, "num_stages": 3, "num_ctas": 1}},
        ],
        "fla.gone.kernel": [{"key": [1], "config": {}}],
    }
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"format": tuned.FORMAT, "device": DEVICE, "versions": VERSIONS, "kernels": entries}))
    line = tuned.seed(DEVICE, path, found)
    assert h.cache == {}  # BV=96 is none of its candidates; a nested key and a nested config value are not data
    assert p.cache == {(1,): chosen_before, (2,): p.configs[2]}  # the earlier choice stands
    assert "1 FLA autotuning choices taken" in line and "5 of its 6 not" in line


@pytest.mark.parametrize(
    "table, said",
    [
        ({"device": "NVIDIA A100-SXM4-80GB", "versions": VERSIONS}, "is for NVIDIA A100-SXM4-80GB, fla 0.6.0"),
        ({"device": DEVICE, "versions": {"fla": "0.5.4", "triton": "3.6.0"}}, "this is NVIDIA H200, fla 0.6.0"),
        ({"device": DEVICE, "versions": VERSIONS, "format": "other/9"}, "not used"),
    ],
)
def test_a_table_for_another_device_versions_or_format_is_not_used(tmp_path, fixed_versions, table, said):
    found, h, p = _found()
    kernels = {"fla.ops.utils.solve_tril.merge_kernel": [{"key": [1], "config": p.configs[0].all_kwargs()}]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"format": tuned.FORMAT, "kernels": kernels, **table}))
    line = tuned.seed(DEVICE, path, found)
    assert said in line and "FLA autotunes its kernels" in line
    assert p.cache == {}


def test_a_broken_or_missing_table_leaves_autotuning_alone(tmp_path, fixed_versions, caplog):
    found, _h, p = _found()
    broken = tmp_path / "b.json"
    broken.write_text('{"format": ')
    assert "not used" in tuned.seed(DEVICE, broken, found)
    assert "unreadable" in caplog.text
    assert "none shipped for NVIDIA H200" in tuned.seed(DEVICE, tmp_path / "missing.json", found)
    assert p.cache == {}


def test_the_shipped_table_is_found_by_device_kind(tmp_path, fixed_versions, monkeypatch):
    found, _h, p = _found()
    p.cache[(7,)] = p.configs[1]
    monkeypatch.setattr(tuned, "SHIPPED", tmp_path)
    tuned.save(tmp_path / "NVIDIA_H200.json", DEVICE, found)
    fresh, _h2, p2 = _found()
    assert "1 FLA autotuning choices taken from NVIDIA_H200.json" in tuned.seed(DEVICE, tuners=fresh)
    assert p2.cache == {(7,): p2.configs[1]}


def test_save_merges_with_the_table_of_the_same_versions_and_replaces_another(tmp_path, fixed_versions, monkeypatch):
    path = tmp_path / "t.json"
    found, h, p = _found()
    p.cache[(1,)], p.cache[(2,)] = p.configs[0], p.configs[1]
    tuned.save(path, DEVICE, found)
    found, h, p = _found()
    p.cache[(2,)], p.cache[(3,)] = p.configs[2], p.configs[0]  # key 2 chosen again, differently; key 3 new
    assert tuned.save(path, DEVICE, found) == 3
    table = json.loads(path.read_text())["kernels"]["fla.ops.utils.solve_tril.merge_kernel"]
    got = {tuple(e["key"]): e["config"] for e in table}
    assert got == {(1,): p.configs[0].all_kwargs(), (2,): p.configs[2].all_kwargs(), (3,): p.configs[0].all_kwargs()}
    monkeypatch.setattr(tuned, "versions", lambda: {"fla": "0.6.1", "triton": "3.6.0"})
    found, h, p = _found()
    p.cache[(9,)] = p.configs[0]
    assert tuned.save(path, DEVICE, found) == 1  # another FLA: the old choices are not mixed in


def _worker_table(tmp_path, name, chosen, versions=None, device=DEVICE):
    """A table as one xdist worker of the CUDA tier saves it: `chosen` maps a merge_kernel key to a candidate index."""
    found, _h, p = _found()
    for key, i in chosen.items():
        p.cache[key] = p.configs[i]
    path = tmp_path / name
    tuned.save(path, device, found)
    if versions is not None:
        data = json.loads(path.read_text())
        path.write_text(json.dumps({**data, "versions": versions}))
    return path


def test_merge_folds_the_workers_tables_into_one_and_the_later_choice_wins(tmp_path, fixed_versions, capsys):
    a = _worker_table(tmp_path, "kc.json.gw0", {(1,): 0, (2,): 1})
    b = _worker_table(tmp_path, "kc.json.gw1", {(2,): 2, (5,): 0})
    out = tmp_path / "NVIDIA_H100_80GB_HBM3.json"
    assert tuned.main(["merge", str(out), str(a), str(b)]) == 0
    assert "3 entries" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["device"] == DEVICE and data["versions"] == VERSIONS and data["format"] == tuned.FORMAT
    got = {tuple(e["key"]): e["config"] for e in data["kernels"]["fla.ops.utils.solve_tril.merge_kernel"]}
    _, _, p = _found()
    assert got == {(1,): p.configs[0].all_kwargs(), (2,): p.configs[2].all_kwargs(), (5,): p.configs[0].all_kwargs()}
    c = _worker_table(tmp_path, "kc.json.gw2", {(7,): 1})  # a later run adds to the table it made
    assert tuned.merge(out, [c]) == 4
    fresh, _h2, p2 = _found()  # and a fresh process seeds all of it
    assert "4 FLA autotuning choices taken" in tuned.seed(DEVICE, out, fresh)
    assert p2.cache[(2,)] is p2.configs[2]


def test_merge_refuses_tables_of_other_devices_or_versions(tmp_path, fixed_versions, capsys):
    a = _worker_table(tmp_path, "a.json", {(1,): 0})
    old = _worker_table(tmp_path, "old.json", {(1,): 1}, versions={"fla": "0.5.4", "triton": "3.6.0"})
    out = tmp_path / "out.json"
    assert tuned.main(["merge", str(out), str(a), str(old)]) == 2
    assert "old.json is for NVIDIA H200, fla 0.5.4" in capsys.readouterr().err and not out.exists()
    other = _worker_table(tmp_path, "other.json", {(1,): 0}, device="NVIDIA H100 80GB HBM3")
    tuned.merge(out, [a])
    with pytest.raises(ValueError, match="holds the kernel configs of NVIDIA H200"):
        tuned.merge(out, [other])
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="none of"):
        tuned.merge(out, [tmp_path / "broken.json"])


def test_covered_names_the_shipped_tables_devices_and_seed_says_them(tmp_path, fixed_versions, monkeypatch):
    monkeypatch.setattr(tuned, "SHIPPED", tmp_path)
    _worker_table(tmp_path, "NVIDIA_H200.json", {(1,): 0})
    _worker_table(tmp_path, "NVIDIA_H100_80GB_HBM3.json", {(1,): 0}, device="NVIDIA H100 80GB HBM3")
    (tmp_path / "junk.json").write_text("[]")
    assert tuned.covered() == ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]
    line = tuned.seed("NVIDIA A100-SXM4-80GB", tuners={})
    assert "none shipped for NVIDIA A100-SXM4-80GB (tables ship for NVIDIA H100 80GB HBM3, NVIDIA H200)" in line


def test_the_shipped_tables_are_each_for_the_device_their_name_says():
    names = sorted(tuned.SHIPPED.glob("*.json"))
    assert names, "no kernel table ships"
    for path in names:
        data = json.loads(path.read_text())
        assert data["format"] == tuned.FORMAT and tuned.device_slug(data["device"]) == path.stem
        assert sum(len(v) for v in data["kernels"].values()) > 0


@pytest.mark.cuda
def test_seeded_choices_run_the_real_kernels_and_pass_the_selftest(tmp_path):
    """On a GPU with FLA: after a self-test every GDN-path autotuner has chosen; the table made from that, seeded
    into emptied autotuners, is taken whole (each choice one of the kernel's candidates) and the kernels so
    configured pass the self-test against the fp32 reference again."""
    import torch

    from hybridtune.kernels.selftest import layouts_from_config, verify
    from hybridtune.mixers.gdn import ops as gdn
    from hybridtune.models.presets import preset_config

    if gdn.backend("cuda")[0] != "fla":
        pytest.skip("flash-linear-attention not installed")
    layouts = layouts_from_config(preset_config("qwen3_5-2b"))
    assert all(v.passed for v in verify(layouts, use_cache=False))
    device = torch.cuda.get_device_name(0)
    path = tmp_path / "t.json"
    n = tuned.save(path, device)
    assert n > 0
    found = tuned.autotuners()
    for tuner in found.values():
        tuner.cache.clear()
    line = tuned.seed(device, path, found)
    assert f"{n} FLA autotuning choices taken" in line and "of its" not in line, line
    assert all(any(c is cand for cand in t.configs) for t in found.values() for c in t.cache.values())
    assert all(v.passed for v in verify(layouts, use_cache=False))


def test_the_shipped_h200_table_is_a_valid_table_of_its_name():
    path = tuned.SHIPPED / "NVIDIA_H200.json"
    table = tuned._read(path)
    assert table is not None and table["device"] == DEVICE and tuned.device_slug(table["device"]) == path.stem
    assert set(table["versions"]) == {"fla", "triton"} and all(table["versions"].values())
    entries = [e for v in table["kernels"].values() for e in v]
    assert entries and all(tuned._entry(e)[0] is not None for e in entries)
    assert all(name.startswith("fla.") for name in table["kernels"])
    assert tuned.digest(DEVICE) != "none" and tuned.digest("Some Other GPU") == "none"


def test_fla_cache_mode_set_means_flas_own_files_choose(tmp_path, fixed_versions, monkeypatch):
    found, _h, p = _found()
    p.cache[(1,)] = p.configs[0]
    tuned.save(tmp_path / "t.json", DEVICE, found)
    fresh, _h2, p2 = _found()
    monkeypatch.setenv("FLA_CACHE_MODE", "strict")
    assert "FLA_CACHE_MODE=strict is set" in tuned.seed(DEVICE, tmp_path / "t.json", fresh)
    assert p2.cache == {}


def test_save_refuses_a_table_of_another_device_and_seed_counts_unknown_kernels(tmp_path, fixed_versions):
    found, h, p = _found()
    p.cache[(1,)] = p.configs[0]
    path = tmp_path / "t.json"
    tuned.save(path, "NVIDIA A100-SXM4-80GB", found)
    before = path.read_text()
    with pytest.raises(ValueError, match="holds the kernel configs of NVIDIA A100-SXM4-80GB, not NVIDIA H200"):
        tuned.save(path, DEVICE, found)
    assert path.read_text() == before  # nothing of the other GPU's table lost
    data = json.loads(before)
    data["device"] = DEVICE
    data["kernels"]["fla.renamed.kernel"] = [{"key": [1], "config": {}}]
    path.write_text(json.dumps(data))
    fresh, _h2, _p2 = _found()
    assert "1 of its kernels not in this FLA" in tuned.seed(DEVICE, path, fresh)
