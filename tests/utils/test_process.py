"""Importing zeal changes nothing in the process; the commands apply the ``process``
section before torch allocates anything; one cache folder, one bf16 detector."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zeal.config.process import ProcessConfig
from zeal.utils.hardware import cpu_has_native_bf16
from zeal.utils.paths import cache_dir
from zeal.utils.process import apply_process_settings

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, **env: str) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON line, returned parsed."""
    full_env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    full_env.update(PYTHONPATH=str(ROOT), **env)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, cwd=ROOT,
                       timeout=100)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_import_zeal_has_no_side_effects_on_the_process():
    out = _python(
        "import json, os, torch; env = dict(os.environ); n = torch.get_num_threads()\n"
        "import zeal, zeal.inference, zeal.config, zeal.utils.process\n"
        "print(json.dumps({'env': {k: v for k, v in os.environ.items() if env.get(k) != v},\n"
        "                  'gone': sorted(set(env) - set(os.environ)), 'threads': [n, torch.get_num_threads()]}))")
    assert out["env"] == {} and out["gone"] == []
    assert out["threads"][0] == out["threads"][1]


def test_import_zeal_inference_does_not_load_the_training_stack():
    out = _python("import json, sys; import zeal.inference\n"
                  "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('zeal.train', 'zeal.zero')))))")
    assert out == []
    out = _python("import json, sys; import zeal\n"
                  "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('zeal.train', 'zeal.zero',\n"
                  "                                                                 'zeal.inference')))))")
    assert out == []  # `import zeal` loads neither stack until it is used
    out = _python("import json, zeal; print(json.dumps([zeal.initialize.__module__, zeal.LLM.__module__]))")
    assert out == ["zeal.train.build", "zeal.inference.llm"]


def _thp_available() -> bool:
    try:
        return "[never]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


HUGE = ("big = torch.ones(64 << 20)\n"  # 256 MB: on huge pages if torch saw THP_MEM_ALLOC_ENABLE=1 first
        "huge = sum(int(l.split()[1]) for l in open('/proc/self/smaps_rollup') if l.startswith('AnonHugePages'))\n")


@pytest.mark.skipif(not _thp_available(), reason="transparent huge pages are off on this machine")
@pytest.mark.parametrize("command", ["train", "serve"])
def test_the_commands_apply_huge_pages_before_torch_allocates(command):
    """The commands build their config (importing torch and the model code) and then
    apply the process section: torch must not have allocated before, or it never reads
    THP_MEM_ALLOC_ENABLE. Off by config, nothing is set."""
    build = {
        "train": "from zeal.cli.train import build_spec\nfrom zeal.cli.main import build_parser\n"
                 "args, extra = build_parser('train')[0].parse_known_args(['train'] + FLAGS)\n"
                 "cfg = build_spec(args, extra)\n",
        "serve": "from zeal.cli.serve import config_from_args\nfrom zeal.cli.main import build_parser\n"
                 "args = build_parser('serve')[0].parse_args(['serve'] + FLAGS)\ncfg = config_from_args(args)\n",
    }[command]
    off = {"train": ["--process.transparent_hugepages", "false"], "serve": ["--no-transparent-hugepages"]}[command]
    for flags, on in (([], True), (off, False)):
        out = _python(f"import json, os, torch\nFLAGS = {flags!r}\n{build}"
                      "from zeal.utils.process import apply_process_settings\n"
                      f"apply_process_settings(cfg.process)\n{HUGE}"
                      "print(json.dumps([os.environ.get('THP_MEM_ALLOC_ENABLE'), huge]))")
        assert out[0] == ("1" if on else None)
        assert (out[1] > 0) is on, out


def test_process_settings_threads_and_environment_override(monkeypatch):
    import torch

    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")  # the environment wins (the documented opt-out)
    n = torch.get_num_threads()
    try:
        applied = apply_process_settings({"num_threads": 1})
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(n)
    assert applied["THP_MEM_ALLOC_ENABLE"] == "0" and os.environ["THP_MEM_ALLOC_ENABLE"] == "0"
    assert applied["num_threads"] == 1
    assert apply_process_settings(ProcessConfig(transparent_hugepages=False)) == {}
    # glibc thresholds last for the whole process: tried in a child
    out = _python("import json\nfrom zeal.utils.process import apply_process_settings\n"
                  "print(json.dumps(apply_process_settings({'malloc_release_threshold': 1 << 20})))")
    assert isinstance(out["malloc_release_threshold"], bool)
    if sys.platform == "linux" and os.confstr("CS_GNU_LIBC_VERSION"):
        assert out["malloc_release_threshold"] is True


def test_one_cache_folder(monkeypatch, tmp_path):
    from zeal.data.text_dataset import cache_dir as data_cache
    from zeal.inference import kernels
    from zeal.inference.loader import cache_dir as llm_cache

    monkeypatch.setenv("ZEAL_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path and data_cache is cache_dir and llm_cache is cache_dir
    assert kernels.cache_dir is cache_dir
    monkeypatch.delenv("ZEAL_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "zeal"


def test_one_bf16_detector(monkeypatch):
    from zeal.config import inference, job
    from zeal.config.job import JobSpec, resolve_precision

    assert inference.cpu_has_native_bf16 is cpu_has_native_bf16  # serve's "auto" dtype
    assert cpu_has_native_bf16("flags\t: avx2 avx512_bf16\n") and not cpu_has_native_bf16("flags\t: avx2\n")
    for native in (True, False):
        monkeypatch.setattr("zeal.utils.hardware.native_bf16", lambda device=None, v=native: v)
        assert resolve_precision(JobSpec()).engine["bf16"]["enabled"] is native
    assert not hasattr(job, "native_bf16")
