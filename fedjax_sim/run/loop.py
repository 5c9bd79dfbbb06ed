"""The run loop shared by `simulate`, `simulate_streamed` and `sweep` (flax/CLU style: the
loop is separated from the step).

A driver provides a `ChunkSource`: how to run rounds `start + 1 .. stop` (one compiled chunk)
and how to evaluate a state. `run_loop` owns the rest: the chunk boundaries (evaluation and
checkpoint rounds), evaluation rows (with the privacy accountant's epsilon), the NaN guard,
the progress bar, the history files, checkpoints with resume (key and run-setting checks),
and Ctrl-C (a checkpoint at the last chunk boundary, then `Interrupted`). A run has one
history per run it computes (a sweep: R; the others: 1).
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol, TypedDict

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim.core.checks import config_diff
from fedjax_sim.run.checkpoint import Checkpointer, CheckpointError, deferred_sigint
from fedjax_sim.run.history import History, HistoryWriter, jsonable
from fedjax_sim.runtime import distributed

# meta entries that name what a run computes: a resume refuses a checkpoint that differs
RUN_IDENTITY = ("config", "hparams", "seed")


class NonFiniteError(FloatingPointError):
    """The global model became NaN/Inf."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C stopped the run after `round` completed rounds; `checkpoint` is the folder of
    the checkpoint that holds them (None without a `checkpoint_dir`)."""

    def __init__(self, round_: int, checkpoint: str | None):
        super().__init__(f"interrupted at round {round_}")
        self.round = round_
        self.checkpoint = checkpoint

    def message(self) -> str:
        """One line for the user: where the run stopped and how to go on from there."""
        where = (
            f"checkpoint saved to {self.checkpoint}; rerun the same command with --resume"
            if self.checkpoint
            else "nothing saved (--checkpoint-every N saves progress)"
        )
        return f"interrupted at round {self.round}; {where}"


class ChunkSource(Protocol):
    """What a driver gives `run_loop`: its chunks of rounds and its evaluation."""

    def run(self, state: Any, start: int, stop: int) -> tuple[Any, list[dict[str, np.ndarray]]]:
        """Rounds `start + 1 .. stop`: the new state and, per run, host metrics
        `[stop - start, ...]` including `params_finite [stop - start]`."""
        ...

    def evaluate(self, state: Any) -> list[dict[str, float]]:
        """One evaluation row per run (may be empty dicts)."""
        ...

    def saved(self, state: Any) -> Any:
        """The pytree a checkpoint holds for `state` (e.g. host rows written back)."""
        ...

    def restored(self, tree: Any) -> Any:
        """The running state for a checkpoint's pytree (the inverse of `saved`)."""
        ...


class RunOptions(TypedDict, total=False):
    """What every driver (`simulate`, `simulate_streamed`, `sweep`) does around its chunks,
    passed as keyword arguments and forwarded to `run_loop` as they are.

    Attributes:
      out_dir: files of the history (`HistoryWriter`: `history.csv` / `.jsonl` appended after
        every chunk, in constant time per evaluation; `history.json` / `.png` at the end,
        also on errors and Ctrl-C; nothing before the first chunk completes). A sweep
        writes its results there at the end (`SweepResult.save`).
      checkpoint_dir / checkpoint_every: orbax checkpoints of the full state, key and
        history every `checkpoint_every` rounds (and at the end / on Ctrl-C). A run that
        does not resume replaces older checkpoints there at its own first save.
      resume: continue from the latest checkpoint in `checkpoint_dir` (bit-identical; the key
        and the run settings are checked).
      progress: show a tqdm progress bar (default True).
      on_resume: called with the restored round after a resume, before compiling.
      privacy: `rounds -> epsilon` (e.g. `accounting.PrivacyAccounting(...).epsilon`),
        evaluated on the host at every evaluation: `epsilon` in the evaluation rows and the
        progress bar.
    """

    out_dir: str | None
    checkpoint_dir: str | None
    checkpoint_every: int | None
    resume: bool
    progress: bool
    on_resume: Callable[[int], None] | None
    privacy: Callable[[int], float] | None


DEFAULT_OPTIONS: RunOptions = {
    "out_dir": None,
    "checkpoint_dir": None,
    "checkpoint_every": None,
    "resume": False,
    "progress": True,
    "on_resume": None,
    "privacy": None,
}


def run_options(driver: str, options: Mapping[str, Any], num_rounds: int, every: int) -> RunOptions:
    """`options` completed with the defaults, after the checks every driver makes before any
    work: unknown names (TypeError, as Python's for a keyword argument) and impossible
    values (ValueError)."""
    unknown = sorted(set(options) - set(DEFAULT_OPTIONS))
    if unknown:
        raise TypeError(f"{driver}() got an unexpected keyword argument {unknown[0]!r}")
    o: RunOptions = {**DEFAULT_OPTIONS, **options}  # type: ignore[typeddict-item]
    if num_rounds < 1:
        raise ValueError(f"num_rounds must be >= 1, got {num_rounds}")
    if every < 1:
        raise ValueError(f"evaluation.every must be >= 1, got {every}")
    if o["checkpoint_every"] is not None and o["checkpoint_every"] < 1:
        raise ValueError(f"checkpoint_every must be >= 1, got {o['checkpoint_every']}")
    if (o["checkpoint_every"] or o["resume"]) and not o["checkpoint_dir"]:
        raise ValueError("checkpoint_every/resume need a checkpoint_dir")
    return o


def chunk_length(num_rounds: int, every: int, checkpoint_every: int | None) -> int:
    """Static length of the compiled chunk: the longest span `spans` can give."""
    return max(1, min(num_rounds, every, checkpoint_every or num_rounds))


def spans(
    start: int, num_rounds: int, every: int, checkpoint_every: int | None
) -> list[tuple[int, int]]:
    """`[(start, stop), ...]` of the chunks from round `start`: each ends at the next
    evaluation or checkpoint round (or the last round)."""
    out, r = [], start
    while r < num_rounds:
        end = min(
            num_rounds,
            _next_multiple(r, every),
            _next_multiple(r, checkpoint_every) if checkpoint_every else num_rounds,
        )
        out.append((r, end))
        r = end
    return out


def run_loop(
    source: ChunkSource,
    state: Any,
    key: jax.Array,
    metas: Sequence[dict[str, Any]],
    *,
    num_rounds: int,
    every: int,
    options: RunOptions,
    nonfinite: Literal["raise", "mark"] = "raise",
    nonfinite_hint: str = "lower the learning rates or check the data",
) -> tuple[list[History], Any]:
    """Runs `source` from `state` (or the latest checkpoint) to `num_rounds`; returns the
    histories (one per entry of `metas`, their initial `History.meta`) and the final state.

    Args:
      key: the run key (a sweep: `[R]` keys), saved with every checkpoint and checked on
        resume.
      every: rounds between evaluations (also after the last round).
      options: `run_options(...)`'s complete `RunOptions` (`out_dir`: one run only); a
        resume also refuses a checkpoint whose runs differ in `RUN_IDENTITY` meta entries.
      nonfinite: "raise" NonFiniteError at the first non-finite round (`nonfinite_hint`
        ends the message); "mark": record it in that run's `meta["nonfinite_round"]`.

    Raises NonFiniteError, Interrupted (Ctrl-C; after a checkpoint if possible) and
    CheckpointError (an unusable checkpoint).
    """
    out_dir, checkpoint_dir, checkpoint_every = (
        options["out_dir"],
        options["checkpoint_dir"],
        options["checkpoint_every"],
    )
    resume, progress, privacy = options["resume"], options["progress"], options["privacy"]
    histories = [History(meta=dict(m)) for m in metas]
    if out_dir and len(histories) != 1:
        raise ValueError("run_loop writes history files of one run; save several runs after")
    writer = distributed.is_main_process()
    start = 0
    ckpt = Checkpointer(checkpoint_dir, replace=not resume) if checkpoint_dir else None
    if resume and ckpt is not None and ckpt.latest_round() is not None:
        start, tree, saved_key, saved = ckpt.restore(source.saved(state), key)
        if not np.array_equal(jax.random.key_data(saved_key), jax.random.key_data(key)):
            raise CheckpointError(
                "resume: the checkpoint was written by a run with a different key (seed)"
            )
        histories = _resumed(saved, metas, start)
        state = source.restored(tree)
        if options["on_resume"] is not None:
            options["on_resume"](start)
        if start >= num_rounds:
            return histories, state
    files = HistoryWriter(out_dir) if out_dir and writer else None
    state = owned(state)  # the chunks donate it

    def do_eval(round_: int, state: Any) -> list[dict[str, float]]:
        rows = source.evaluate(state)
        extra = {} if privacy is None else {"epsilon": float(privacy(round_))}
        for h, row in zip(histories, rows, strict=True):
            h.append_eval(round_, {**row, **extra})
        return [{**row, **extra} for row in rows]

    def save(r: int) -> None:
        for h in histories:
            h.meta["seconds"] = time.perf_counter() - t0
        ckpt.save(r, source.saved(state), key, _payload(histories))

    bar = _progress(progress and writer, num_rounds, start)
    r = last_saved = start
    t0 = time.perf_counter()
    stop = _StopRequest(notice=progress and writer)
    try:
        stop.__enter__()
        evals = histories[0].evals
        if start % every == 0 and (not evals or evals[-1]["round"] < start):
            do_eval(start, state)  # round 0, or a Ctrl-C in the evaluation before a save
        for r0, r1 in spans(start, num_rounds, every, checkpoint_every):
            if stop.requested:
                raise KeyboardInterrupt
            new_state, metrics = source.run(state, r0, r1)
            for i, (h, m) in enumerate(zip(histories, metrics, strict=True)):
                finite = np.asarray(m.pop("params_finite"))
                h.append_rounds(r0 + 1, m)
                if finite.all():
                    continue
                bad = r0 + 1 + int(np.argmin(finite))
                if nonfinite == "mark":
                    h.meta.setdefault("nonfinite_round", bad)
                    continue
                if files is not None:
                    files.append(h)
                loss = m.get("train_loss", [np.nan] * (bad - r0))[bad - r0 - 1]
                raise NonFiniteError(
                    f"the global model became NaN/Inf at round {bad} "
                    f"(train_loss there: {loss}); {nonfinite_hint}"
                    + ("" if len(histories) == 1 else f" (run {i})")
                )
            state, r = new_state, r1
            values = do_eval(r, state) if r % every == 0 or r == num_rounds else []
            if bar is not None:
                bar.update(r1 - bar.n)
                bar.set_postfix(_postfix(metrics, values), refresh=False)
            if files is not None:
                files.append(histories[0])
            if ckpt and checkpoint_every and (r % checkpoint_every == 0 or r == num_rounds):
                save(r)
                last_saved = r
    except KeyboardInterrupt:
        for h in histories:
            h.truncate(r)  # rows of a chunk whose state was not kept
        if not alive(state):  # a second Ctrl-C inside a chunk: round r's state was donated
            if ckpt and ckpt.latest_round() is not None:
                r = last_saved  # the rounds the checkpoint holds
                for h in histories:
                    h.truncate(r)
        elif ckpt and (r > last_saved or ckpt.latest_round() is None):
            save(r)
        saved_to = ckpt.directory if ckpt and ckpt.latest_round() is not None else None
        raise Interrupted(r, saved_to) from None
    finally:
        stop.__exit__()
        if bar is not None:
            bar.close()
        for h in histories:
            h.meta["seconds"] = time.perf_counter() - t0
        if files is not None and files.started:
            with deferred_sigint():
                files.finish(histories[0])
        if ckpt:
            ckpt.close()
    return histories, state


def _payload(histories: list[History]) -> dict[str, Any]:
    """A checkpoint's JSON: one run's history dict (its `meta["config"]` is read by the CLI),
    or `{"histories": [...]}`."""
    if len(histories) == 1:
        return histories[0].to_dict()
    return {"histories": [h.to_dict() for h in histories]}


def _resumed(saved: dict[str, Any], metas: Sequence[dict[str, Any]], start: int) -> list[History]:
    """The histories of a checkpoint (truncated to `start`, metas updated), after checking
    that they are of the same runs as `metas`."""
    dicts = saved["histories"] if "histories" in saved else [saved]
    if len(dicts) != len(metas):
        raise CheckpointError(
            f"resume: the checkpoint holds {len(dicts)} runs, this run has {len(metas)}"
        )
    out = []
    for d, meta in zip(dicts, metas, strict=True):
        h = History.from_dict(d)
        for k in RUN_IDENTITY:
            saved_k, this_k = h.meta.get(k), meta.get(k)
            if k in meta and isinstance(saved_k, dict) and isinstance(this_k, dict):
                # a command line's settings (the CLI's meta["config"]): those that may change
                # between a run and its resumption (more --rounds, --resume, ...) may differ
                diffs = config_diff(saved_k, this_k)
                if diffs:
                    raise CheckpointError(
                        f"resume: the checkpoint was written with other settings: "
                        f"{'; '.join(diffs)}"
                    )
            elif k in meta and _norm(saved_k) != _norm(this_k):
                raise CheckpointError(
                    f"resume: the checkpoint was written by a run with another {k} "
                    f"({h.meta.get(k)!r} != {meta[k]!r})"
                )
        h.truncate(start)
        h.meta.update(meta)
        out.append(h)
    return out


def _norm(value: Any) -> Any:
    """`value` as its JSON round trip gives it back (tuples as lists)."""
    return json.loads(json.dumps(jsonable(value)))


def owned(tree: Any) -> Any:
    """Fresh copies of `tree`'s arrays: a state the chunks may donate without deleting
    arrays the caller still holds (the params passed in, a restored checkpoint)."""
    return jax.tree.map(lambda a: jnp.copy(a) if isinstance(a, jax.Array) else a, tree)


def alive(tree: Any) -> bool:
    """No array of `tree` was donated (deleted) yet."""
    return not any(a.is_deleted() for a in jax.tree.leaves(tree) if isinstance(a, jax.Array))


class _StopRequest:
    """Ctrl-C handling of a run (main thread only): the first SIGINT asks the run to stop at
    the next chunk boundary (where the state is consistent and a checkpoint is saved); a
    second one raises KeyboardInterrupt at once. A KeyboardInterrupt raised inside JAX
    internals can be swallowed (e.g. in a garbage-collection callback); a flag cannot."""

    def __init__(self, notice: bool):
        self.requested = False
        self.notice = notice
        self._previous: Any = None

    def __enter__(self) -> _StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        if self.notice:
            print(
                "\nstopping after the current chunk of rounds (Ctrl-C again to stop now)",
                file=sys.stderr,
                flush=True,
            )

    def __exit__(self, *exc: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def _next_multiple(r: int, every: int) -> int:
    return (r // every + 1) * every


def _progress(enabled: bool, total: int, initial: int):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, unit="round", dynamic_ncols=True)


def _postfix(
    metrics: list[dict[str, np.ndarray]], values: list[dict[str, float]]
) -> dict[str, str]:
    """Loss of the last round, test accuracy and epsilon (means over runs)."""
    out = {}
    if "train_loss" in metrics[0]:
        loss = np.nanmean([float(np.asarray(m["train_loss"])[-1]) for m in metrics])
        out["loss"] = f"{loss:.4f}"
    if values and "test_accuracy" in values[0]:
        out["acc"] = f"{np.nanmean([v['test_accuracy'] for v in values]):.4f}"
    if values and "epsilon" in values[0]:
        out["eps"] = f"{values[0]['epsilon']:.3g}"
    return out
