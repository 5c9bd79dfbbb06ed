"""Issue 19: Ctrl-C and resume end to end, checkpoint writes atomic under SIGKILL, the
append-only history equal to a full rewrite."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np

from fedjax_sim.app import validate
from fedjax_sim.app.config import RunConfig
from fedjax_sim.run.history import History, HistoryWriter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}


def _cli(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fedjax_sim", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=_env(),
        timeout=600,
    )


def test_ctrl_c_saves_and_resume_continues(tmp_path):
    """SIGINT after the first chunk: exit 130, one line with the round and the checkpoint,
    no traceback; `--resume` says where it resumed and the history continues seamlessly."""
    args = ["run", "--no-progress", "--eval-every", "5", "--num-clients", "20"]
    args += ["--hidden", "8", "--local-steps", "2", "--cohort-size", "4"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedjax_sim", *args, "--rounds", "100000"],
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    flags = dict(progress=False, eval_every=5, num_clients=20, hidden=(8,), local_steps=2)
    out = tmp_path / validate.check_run(RunConfig(**flags, cohort_size=4))  # its own folder
    csv = out / "history.csv"
    deadline = time.time() + 300
    while not csv.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    line = [ln for ln in err.splitlines() if "interrupted at round" in ln][0]
    stopped = int(line.split("interrupted at round ")[1].split(";")[0])
    assert stopped > 0 and "rerun the same command with --resume" in line
    ckpts = out / "checkpoints"
    assert str(stopped) in os.listdir(ckpts)
    hist = json.loads((out / "history.json").read_text())
    assert hist["rounds"] == list(range(1, stopped + 1))  # summary written on interrupt

    done = _cli(*args, "--rounds", str(stopped + 5), "--resume", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"resumed from round {stopped}" in done.stdout
    hist = History.load(str(out / "history.json"))
    assert hist.rounds == list(range(1, stopped + 6))
    rows = csv.read_text().splitlines()
    assert [int(r.split(",")[0]) for r in rows[1:]] == list(range(stopped + 6))


SAVER = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp
    from fedjax_sim.run.checkpoint import Checkpointer
    ckpt = Checkpointer(sys.argv[1], max_to_keep=2)
    for r in range(1, 1000):
        print(r, flush=True)
        state = {"w": jnp.full((4_000_000,), float(r)), "b": jnp.full((3,), float(r))}
        ckpt.save(r, state, jax.random.key(0), {"round": r})
    """
)


def test_checkpoint_survives_sigkill_during_save(tmp_path):
    """A process killed while saving leaves the latest complete checkpoint usable."""
    import jax
    import jax.numpy as jnp

    from fedjax_sim.run.checkpoint import Checkpointer

    for delay in (0.0, 0.05, 0.15):
        directory = tmp_path / f"ck{delay}"
        proc = subprocess.Popen(
            [sys.executable, "-c", SAVER, str(directory)],
            env=_env(),
            stdout=subprocess.PIPE,
            text=True,
        )
        for line in proc.stdout:  # the 3rd save has started: rounds 1 and 2 are complete
            if line.strip() == "3":
                break
        time.sleep(delay)
        proc.kill()
        proc.wait()
        ckpt = Checkpointer(str(directory))
        like = {"w": jnp.zeros((4_000_000,)), "b": jnp.zeros((3,))}
        round_, state, _, history = ckpt.restore(like, jax.random.key(0))
        ckpt.close()
        assert round_ >= 2 and history == {"round": round_}
        np.testing.assert_array_equal(np.asarray(state["b"]), np.full(3, float(round_)))
        assert float(state["w"][-1]) == round_


def test_history_writer_appends_what_a_rewrite_writes(tmp_path):
    hist = History()
    writer = HistoryWriter(str(tmp_path))
    hist.append_eval(0, {"test_accuracy": 0.1})
    for start in (1, 4, 7):
        hist.append_rounds(start, {"train_loss": np.arange(3.0) + start, "vec": np.ones((3, 2))})
        hist.append_eval(start + 2, {"test_accuracy": 0.5, "test_loss": 1.0})
        writer.append(hist)
    hist.append_rounds(10, {"train_loss": np.array([9.0]), "vec": np.ones((1, 2))})
    hist.append_eval(10, {"test_accuracy": 0.9, "test_loss": 0.5, "new_column": 1.0})
    writer.finish(hist, plot=False)  # a new column: rewritten once
    assert (tmp_path / "history.csv").read_bytes().decode() == hist.to_csv()
    lines = (tmp_path / "history.jsonl").read_text().splitlines()
    assert len(lines) == len(hist.rounds) + len(hist.evals)
    assert History.load(str(tmp_path / "history.json")).to_dict() == hist.to_dict()
    hist2 = History()
    w2 = HistoryWriter(str(tmp_path / "b"))
    hist2.append_eval(0, {"a": 1.0})
    hist2.append_rounds(1, {"train_loss": np.ones(2)})
    w2.append(hist2)
    hist2.append_rounds(3, {"train_loss": np.ones(2)})
    hist2.append_eval(4, {"a": 2.0})
    w2.append(hist2)
    assert (tmp_path / "b" / "history.csv").read_bytes().decode() == hist2.to_csv()
