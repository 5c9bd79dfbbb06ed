"""Checkpoints of a whole simulation (algorithm state incl. round counter, the run key, the
history so far) with orbax. Restoring continues bit-identically.

A save is atomic: orbax writes into a temporary folder and renames it when complete, so a
process killed mid-save leaves the previous checkpoint as the latest one. Ctrl-C during a
save is deferred until the save has finished. Any failure to read a checkpoint (corrupt
files, another algorithm's state) raises `CheckpointError` with a one-line message.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from fedjax_sim.core.checks import first_line


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (missing, corrupt, or of a different run)."""


def _is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _keys_to_data(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def _data_to_keys(tree: Any, like: Any) -> Any:
    return jax.tree.map(
        lambda x, ref: jax.random.wrap_key_data(x) if _is_key(ref) else x, tree, like
    )


@contextlib.contextmanager
def deferred_sigint() -> Iterator[None]:
    """Holds back Ctrl-C (SIGINT) for the duration of the block and delivers it afterwards
    to the previous handler, so a write is never left half done (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            if callable(previous):
                previous(signal.SIGINT, None)  # e.g. a run's "stop at the next chunk" flag
            else:
                raise KeyboardInterrupt


class Checkpointer:
    """Saves/restores `{"state", "key"}` pytrees plus a JSON history under `directory`.

    Nothing is created on disk until the first `save`. With `replace=True` the checkpoints of
    an earlier run in `directory` are deleted at this run's first save (not before, so an
    early failure loses nothing)."""

    def __init__(self, directory: str, max_to_keep: int = 2, *, replace: bool = False):
        self.directory = os.path.abspath(directory)
        self._max_to_keep = max_to_keep
        self._manager: ocp.CheckpointManager | None = None
        self._replace = replace

    def _get(self, create: bool = False) -> ocp.CheckpointManager | None:
        if self._manager is None:
            if not create and not os.path.isdir(self.directory):
                return None
            self._manager = ocp.CheckpointManager(
                self.directory,
                options=ocp.CheckpointManagerOptions(max_to_keep=self._max_to_keep, create=True),
                item_names=("arrays", "history"),
            )
        return self._manager

    def latest_round(self) -> int | None:
        """The round of the latest complete checkpoint (None if there is none)."""
        manager = self._get()
        if manager is None:
            return None
        manager.reload()
        return manager.latest_step()

    def save(self, round_: int, state: Any, key: jax.Array, history: dict) -> None:
        arrays = {"state": _keys_to_data(state), "key": _keys_to_data(key)}
        with deferred_sigint():
            manager = self._get(create=True)
            if self._replace:
                for step in manager.all_steps():
                    manager.delete(step)
                self._replace = False
            manager.save(
                round_,
                args=ocp.args.Composite(
                    arrays=ocp.args.StandardSave(arrays), history=ocp.args.JsonSave(history)
                ),
                force=True,
            )
            manager.wait_until_finished()

    def read_history(self, round_: int | None = None) -> dict:
        """The history (with `meta["config"]`) stored with a checkpoint, without its arrays."""
        round_ = self.latest_round() if round_ is None else round_
        if round_ is None:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        try:
            out = self._get().restore(
                round_, args=ocp.args.Composite(history=ocp.args.JsonRestore())
            )
            history = out["history"]
        except Exception as e:  # orbax raises many kinds; one line for the user
            raise CheckpointError(
                f"checkpoint {self.directory}/{round_} is unreadable ({first_line(e, limit=200)})"
            ) from e
        if not isinstance(history, dict):
            raise CheckpointError(f"checkpoint {self.directory}/{round_} has no valid history")
        return history

    def restore(self, state_like: Any, key_like: jax.Array) -> tuple[int, Any, jax.Array, dict]:
        round_ = self.latest_round()
        if round_ is None:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        target = {"state": _keys_to_data(state_like), "key": _keys_to_data(key_like)}
        target = jax.tree.map(lambda x: np.zeros(np.shape(x), x.dtype), target)
        try:
            out = self._get().restore(
                round_,
                args=ocp.args.Composite(
                    arrays=ocp.args.StandardRestore(target), history=ocp.args.JsonRestore()
                ),
            )
            got = jax.tree.map(lambda x: (np.shape(x), np.dtype(x.dtype)), out["arrays"])
            want = jax.tree.map(lambda x: (np.shape(x), np.dtype(x.dtype)), target)
            if got != want:
                raise ValueError("array shapes or dtypes differ")
            state = _data_to_keys(out["arrays"]["state"], state_like)
            key = _data_to_keys(out["arrays"]["key"], key_like)
        except Exception as e:
            raise CheckpointError(
                f"checkpoint {self.directory}/{round_} does not match this run's state "
                f"(corrupt, or written by another algorithm/model): {first_line(e, limit=200)}"
            ) from e
        return round_, state, key, out["history"]

    def close(self) -> None:
        if self._manager is not None:
            self._manager.close()
