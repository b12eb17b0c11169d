"""The demo's checkpoints with orbax: under one directory, a folder per saved step that holds
"state" (the TrainState's arrays) and "meta" (JSON: what the run needs to continue, such as
the model config, the vocabulary and the history of losses and expert loads)."""

from __future__ import annotations

from pathlib import Path

import orbax.checkpoint as ocp

from moe_xla.demo.train import TrainState


class Checkpoints:
    """The checkpoints under `directory` (created on the first save); saves are asynchronous:
    an array is copied off the device before save() returns and written in the background."""

    def __init__(self, directory: Path):
        self.directory = Path(directory).resolve()
        self._manager = ocp.CheckpointManager(self.directory)

    def steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state: TrainState, meta: dict) -> None:
        """Saves `state` and `meta` as `step`; meta is written in the background, so the caller
        must not change it afterwards."""
        self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                          meta=ocp.args.JsonSave(meta)))

    def latest_meta(self) -> dict:
        """The meta of the newest step."""
        self._manager.wait_until_finished()
        return self._manager.restore(self._manager.latest_step(),
                                     args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

    def restore_latest(self, like: TrainState) -> TrainState:
        """The state of the newest step; `like` gives its structure, shapes and shardings (an
        initial state of the same model)."""
        self._manager.wait_until_finished()
        restored = self._manager.restore(self._manager.latest_step(),
                                         args=ocp.args.Composite(state=ocp.args.StandardRestore(like)))
        return TrainState(*restored.state)

    def delete_all(self) -> None:
        for step in self.steps():
            self._manager.delete(step)

    def close(self) -> None:
        """Waits for the saves still being written."""
        self._manager.close()
