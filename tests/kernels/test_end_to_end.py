"""End to end in a child process: a kernel provisioned under the policy is what the modeling import picks.

Gate-style transformers (5.14.1): the hooked gate fires at the modeling import, installs, and the module binds
FLA. Decorator-style (5.16+): `provision_kernels("auto")` installs before the import and the fallback decorator binds FLA.
The "install" writes a fake `fla` package (the names transformers imports, nothing more) into a temp dir on
sys.path; the child pretends CUDA is present because the gates ask for it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.transformers_compat  # reads transformers' code: run again under another release (CI)

pytest.importorskip("transformers")

CHILD = textwrap.dedent(
    r"""
    import json, pathlib, sys, tempfile
    import torch
    site = pathlib.Path(tempfile.mkdtemp())
    sys.path.insert(0, str(site))
    FAKE_FLA = {
        "fla/__init__.py": "__version__ = '0.6.0'\n",
        "fla/modules/__init__.py": (
            "import torch\n"
            "class FusedRMSNormGated(torch.nn.Module):\n"
            "    def __init__(self, *a, **k):\n"
            "        super().__init__()\n"
        ),
        "fla/ops/__init__.py": "",
        "fla/ops/gated_delta_rule/__init__.py": (
            "def chunk_gated_delta_rule(*a, **k):\n    raise NotImplementedError\n"
            "def fused_recurrent_gated_delta_rule(*a, **k):\n    raise NotImplementedError\n"
        ),
    }

    from hybridtune.kernels.install import InstallResult

    class FakeInstaller:
        def __init__(self):
            self.installs = []
        def command(self, specs):
            return ["pip", "install", *specs]
        def install(self, specs):
            self.installs.append(list(specs))
            for rel, text in FAKE_FLA.items():
                p = site / rel
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text(text)
            return InstallResult(True, self.command(specs))
        def check_import(self, code):
            return True, ""
        def rollback(self, result):
            return True, ""

    import transformers.utils.import_utils as iu
    iu.is_torch_cuda_available = lambda: True  # the gates ask for CUDA; this child has none
    from hybridtune.kernels import gates, provision, report
    from hybridtune.kernels.needs import analyze

    inst = FakeInstaller()
    style = analyze("qwen3_5_text").style
    fired = []
    if style == "gates":
        def on_false(kernel, gate):
            fired.append(kernel)
            if kernel != "fla":
                return False  # no wheel for causal_conv1d: stays on the torch conv
            inst.install(["flash-linear-attention==0.6.0", "fla-core==0.6.0"])
            return True
        gates.install_gate_hooks(on_false, env={})
    else:
        provision.installed_version = lambda name: "0.6.0" if (site / name).exists() else None
        rep = provision.provision_kernels("auto", False, "qwen3_5_text", installer=inst, accelerator="cuda (fake)",
                                selftest=False, env={})
    assert "transformers.models.qwen3_5.modeling_qwen3_5" not in sys.modules
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling
    from hybridtune.models.presets import preset_config
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(preset_config("tiny-qwen3_5", vocab_size=256))
    r = report(model)
    print(json.dumps({"style": style, "fired": fired, "installs": inst.installs,
                      "path": r.mixers[0].path, "symbols": r.mixers[0].symbols}))
    """
)


@pytest.mark.slow  # a fresh interpreter imports torch, transformers and the modeling module (~25 s)
def test_provisioned_kernel_is_what_the_modeling_import_binds():
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["installs"] == [["flash-linear-attention==0.6.0", "fla-core==0.6.0"]]
    if out["style"] == "gates":
        assert out["fired"] == ["causal_conv1d", "fla"]  # each gate asked once, at the modeling import
        assert out["symbols"]["chunk_gated_delta_rule"] == "fla"
    else:
        assert out["fired"] == []
        assert out["symbols"]["torch_chunk_gated_delta_rule"] == "fla"
    assert out["path"] == "transformers -> fla, torch for causal_conv1d"
