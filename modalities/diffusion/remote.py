"""The gateway's diffusion engines under ``--dispatch celery``.

``RemoteDiffusionEngine`` validates a request here, before anything is queued or charged, with
the ``prepare`` of a ``DiffusionEngine`` built over the pipeline's skeleton (its configs, no
weights: the same size, frame, step, guidance and cache rules as the workers' engines), and runs
it on a ``mmserve worker --modality diffusion`` process. A caller that goes away (client
disconnect) aborts the generation on the worker. Job kinds run on the workers' own engines.
"""

from __future__ import annotations

from typing import Any

from workers.remote import Cluster, RemoteEngine


class RemoteDiffusionEngine(RemoteEngine):
    """``prepare`` locally, ``run`` on a worker; ``modality`` is ``image`` or ``video``."""

    def __init__(self, cluster: Cluster, rules: Any) -> None:
        super().__init__(cluster, rules.model_name, rules.modality)
        self.rules = rules  # a DiffusionEngine over a skeleton pipeline: never started
        self.is_video = rules.is_video

    def prepare(self, req: Any) -> Any:
        """``DiffusionEngine.prepare``: ``(Shape, seeds)``, ``ValueError`` for a request the model refuses."""
        return self.rules.prepare(req)

    async def run(self, req: Any) -> Any:
        """The ``GenerateResult`` of ``req`` from a worker (which checks it again)."""
        return await self.call("run", req)
