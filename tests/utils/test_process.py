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


def _thp_available() -> bool:
    try:
        return "[never]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


# One fresh interpreter for every check below (each interpreter start and `import torch` costs
# seconds). Imports first, in the order a user's script has them: each step sees what it would
# see first in a fresh interpreter, as the earlier steps are imported by it anyway. Then the
# commands' config builds, and one fork per config before torch allocates anything: each child
# applies its config as the command does, allocates 256 MB and reads its huge pages (torch
# reads THP_MEM_ALLOC_ENABLE once, at its first allocation).
FRESH = """
import json, os, sys, torch
env, n = dict(os.environ), torch.get_num_threads()
def loaded(*stacks): return sorted(m for m in sys.modules if m.startswith(stacks))
import zeal
bare = loaded('zeal.train', 'zeal.zero', 'zeal.inference')
import zeal.inference
inference = loaded('zeal.train', 'zeal.zero')
import zeal.config, zeal.utils.process
out = {'env': {k: v for k, v in os.environ.items() if env.get(k) != v}, 'gone': sorted(set(env) - set(os.environ)),
       'threads': [n, torch.get_num_threads()], 'bare': bare, 'inference': inference}
out['lazy'] = [zeal.initialize.__module__, zeal.LLM.__module__]
if HUGE_PAGES:
    from zeal.cli.main import build_parser
    from zeal.cli.serve import config_from_args
    from zeal.cli.train import build_spec
    def train(flags): return build_spec(*build_parser('train')[0].parse_known_args(['train'] + flags))
    def serve(flags): return config_from_args(build_parser('serve')[0].parse_args(['serve'] + flags))
    cfgs = {'train': train([]), 'train-off': train(['--process.transparent_hugepages', 'false']),
            'serve': serve([]), 'serve-off': serve(['--no-transparent-hugepages'])}
    from zeal.utils.process import apply_process_settings
    out['huge'] = {}
    for name, cfg in cfgs.items():
        r, w = os.pipe()
        if os.fork() == 0:
            apply_process_settings(cfg.process)
            big = torch.ones(64 << 20)  # 256 MB: on huge pages if torch saw THP_MEM_ALLOC_ENABLE=1 first
            huge = sum(int(l.split()[1]) for l in open('/proc/self/smaps_rollup') if l.startswith('AnonHugePages'))
            os.write(w, json.dumps([os.environ.get('THP_MEM_ALLOC_ENABLE'), huge]).encode())
            os._exit(0)
        os.close(w)
        data = os.read(r, 4096)
        assert os.wait()[1] == 0 and data, name  # the child's traceback is on stderr
        out['huge'][name] = json.loads(data)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def fresh() -> dict:
    """What importing zeal, and the commands' process settings, do in a fresh interpreter."""
    return _python(f"HUGE_PAGES = {_thp_available()}\n{FRESH}")


def test_import_zeal_has_no_side_effects_on_the_process(fresh):
    assert fresh["env"] == {} and fresh["gone"] == []
    assert fresh["threads"][0] == fresh["threads"][1]


def test_import_zeal_inference_does_not_load_the_training_stack(fresh):
    assert fresh["inference"] == []
    assert fresh["bare"] == []  # `import zeal` loads neither stack until it is used
    assert fresh["lazy"] == ["zeal.train.build", "zeal.inference.llm"]


@pytest.mark.skipif(not _thp_available(), reason="transparent huge pages are off on this machine")
@pytest.mark.parametrize("command", ["train", "serve"])
def test_the_commands_apply_huge_pages_before_torch_allocates(command, fresh):
    """The commands build their config (importing torch and the model code) and then
    apply the process section: torch must not have allocated before, or it never reads
    THP_MEM_ALLOC_ENABLE. Off by config, nothing is set."""
    for name, on in ((command, True), (f"{command}-off", False)):
        got = fresh["huge"][name]
        assert got[0] == ("1" if on else None), (name, got)
        assert (got[1] > 0) is on, (name, got)


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
