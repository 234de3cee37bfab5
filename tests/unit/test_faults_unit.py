"""llmtrain/faults.py without processes: the stop flag, the test-fault spec, the collective error's message."""

from __future__ import annotations

import os
import signal

import pytest

from llmtrain import faults


def test_a_stop_signal_sets_the_flag_and_a_repeat_changes_nothing():
    with faults.StopSignals() as stop:
        assert stop.requested is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.requested == "SIGUSR1"
        os.kill(os.getpid(), signal.SIGTERM)  # SLURM to the rank, then torchrun forwarding its own copy
        assert stop.requested == "SIGUSR1"
        assert signal.getsignal(signal.SIGTERM) == stop._handle
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # restored on exit


def test_agree_to_stop_without_a_process_group_is_the_local_flag():
    import torch

    stop = faults.StopSignals()
    assert faults.agree_to_stop(stop, torch.device("cpu")) is False
    stop.requested = "SIGTERM"
    assert faults.agree_to_stop(stop, torch.device("cpu")) is True


def test_collective_failure_names_rank_step_what_and_the_setting(monkeypatch):
    from llmtrain import distributed as parallel

    monkeypatch.setattr(parallel, "_abandoned", False)  # restored after the test
    with pytest.raises(faults.CollectiveFailure) as raised:
        with faults.collective_guard(rank=1, step=7, doing="saving a checkpoint", timeout_s=30):
            raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 30000ms for recv")
    text = str(raised.value)
    assert text.startswith("rank 1: step 7: a collective did not complete while saving a checkpoint (torch: [gloo")
    assert "trainer.collective_timeout_s=30 s" in text and "resume=auto" in text
    assert parallel._abandoned  # shutdown() will not wait on the stalled peer
    with pytest.raises(ValueError, match="not a collective"):  # anything else passes through untouched
        with faults.collective_guard(rank=0, step=1, doing="x", timeout_s=1):
            raise ValueError("not a collective")


def test_test_fault_spec_fires_once_at_its_point(monkeypatch):
    sent = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    monkeypatch.setenv(faults.TEST_FAULT_ENV, "rank=1,step=7,signal=KILL,at=save,target=launcher")
    faults.inject("save", rank=0, step=7)
    faults.inject("step", rank=1, step=7)
    faults.inject("save", rank=1, step=7)
    assert sent == [(os.getppid(), signal.SIGKILL)]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restarted attempt runs clean
    faults.inject("save", rank=1, step=7)
    assert len(sent) == 1
    monkeypatch.setenv(faults.TEST_FAULT_ENV, "rank=1,when=7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    with pytest.raises(ValueError, match="expected rank=R,step=S,signal=NAME"):
        faults.inject("step", rank=1, step=7)
