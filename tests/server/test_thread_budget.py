"""The thread budget (server/media/threads.py): the cores this process may use (affinity, capped by a
cgroup quota), shared out between the engine, speech to text, text to speech and the VAD; onnxruntime's pools never
spin."""

from __future__ import annotations

from pathlib import Path

import pytest
from voice_assets import voice_model

from streamserve.server.media.threads import ThreadBudget, available_cores, cgroup_cpus


@pytest.mark.parametrize(("cores", "stt", "tts", "workers"), [(1, 1, 1, 2), (2, 2, 1, 2), (3, 3, 1, 2),
                                                               (4, 4, 2, 2), (16, 16, 8, 8)])
def test_the_split(cores: int, stt: int, tts: int, workers: int) -> None:
    b = ThreadBudget.plan(cores)
    assert (b.cores, b.stt, b.tts, b.tts_workers, b.vad) == (cores, stt, tts, workers, 1)
    assert b.stt <= cores and b.tts <= cores  # no model is given more threads than there are cores
    assert f"{cores} cores" in b.describe()


def test_threads_override_every_model() -> None:
    b = ThreadBudget.plan(8, threads=3)
    assert (b.stt, b.tts, b.tts_workers) == (3, 3, 3)


def test_a_cgroup_quota_caps_the_cores(tmp_path: Path) -> None:
    quota = tmp_path / "cpu.max"
    for text, cpus in (("max 100000\n", None), ("200000 100000\n", 2.0), ("150000 100000", 1.5), ("junk", None),
                       ("0 100000", None)):
        quota.write_text(text)
        assert cgroup_cpus(quota) == cpus, text
    assert cgroup_cpus(tmp_path / "missing") is None
    quota.write_text("150000 100000")
    assert available_cores(quota) == min(2, available_cores(tmp_path / "missing"))  # 1.5 CPUs: 2 threads at most
    quota.write_text("10000 100000")
    assert available_cores(quota) == 1  # a tenth of a CPU: still one thread


def test_onnxruntime_pools_do_not_spin() -> None:
    from streamserve.media.tts import PiperVoice
    from streamserve.media.vad import SileroVAD

    for model in (SileroVAD(voice_model("silero-vad"), threads=2), PiperVoice(voice_model("piper-joe"), threads=2)):
        options = model.session.get_session_options()
        assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"


def test_the_engine_share_caps_torch_and_keeps_a_lower_choice() -> None:
    import torch

    from streamserve.server.media.loaders import torch_device_is_cpu
    from streamserve.server.media.threads import apply_engine_threads

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        assert apply_engine_threads(ThreadBudget.plan(2)) == 2 == torch.get_num_threads()  # capped at the cores
        torch.set_num_threads(1)
        assert apply_engine_threads(ThreadBudget.plan(2)) == 1  # the user's lower count is kept
        assert "engine 2 threads" in ThreadBudget.plan(2).describe() and ThreadBudget.plan(2).engine == 2
    finally:
        torch.set_num_threads(before)
    assert torch_device_is_cpu("cpu") and not torch_device_is_cpu("cuda:0")
    assert torch_device_is_cpu("auto") == (not torch.cuda.is_available())
