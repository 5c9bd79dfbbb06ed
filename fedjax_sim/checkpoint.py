"""Checkpoints of a whole simulation (algorithm state incl. round counter, the run key, the
history so far) with orbax. Restoring continues bit-identically."""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


def _is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _keys_to_data(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def _data_to_keys(tree: Any, like: Any) -> Any:
    return jax.tree.map(
        lambda x, ref: jax.random.wrap_key_data(x) if _is_key(ref) else x, tree, like
    )


class Checkpointer:
    """Saves/restores `{"state", "key"}` pytrees plus a JSON history under `directory`."""

    def __init__(self, directory: str, max_to_keep: int = 2):
        self.directory = os.path.abspath(directory)
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
            item_names=("arrays", "history"),
        )

    def latest_round(self) -> int | None:
        return self._manager.latest_step()

    def save(self, round_: int, state: Any, key: jax.Array, history: dict) -> None:
        arrays = {"state": _keys_to_data(state), "key": _keys_to_data(key)}
        self._manager.save(
            round_,
            args=ocp.args.Composite(
                arrays=ocp.args.StandardSave(arrays), history=ocp.args.JsonSave(history)
            ),
            force=True,
        )
        self._manager.wait_until_finished()

    def restore(self, state_like: Any, key_like: jax.Array) -> tuple[int, Any, jax.Array, dict]:
        round_ = self.latest_round()
        if round_ is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        target = {"state": _keys_to_data(state_like), "key": _keys_to_data(key_like)}
        target = jax.tree.map(lambda x: np.zeros(np.shape(x), x.dtype), target)
        out = self._manager.restore(
            round_,
            args=ocp.args.Composite(
                arrays=ocp.args.StandardRestore(target), history=ocp.args.JsonRestore()
            ),
        )
        state = _data_to_keys(out["arrays"]["state"], state_like)
        key = _data_to_keys(out["arrays"]["key"], key_like)
        return round_, state, key, out["history"]

    def close(self) -> None:
        self._manager.close()
