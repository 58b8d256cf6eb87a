"""Engine groups: the unit a host serves with. One group runs one deployment on a contiguous
range of the host's GPUs, sharded over `deployment.tensor_parallel_size` of them.

Rules (checked by `api.services.engine_groups` under the host's row lock; the database holds
what it can express):

* a group's GPUs are `first_gpu .. first_gpu + tensor_parallel_size - 1`, all within
  `0 .. host.gpu_count - 1`;
* the groups of one host never share a GPU;
* `index` numbers a host's groups (unique per host); the agent reports each group under it.
"""

from __future__ import annotations

from django.db import models

from api.models.fleet import Deployment, GpuHost


class EngineGroup(models.Model):
    """`deployment` served on GPUs `first_gpu ..` of `host` (see the module docstring)."""

    host = models.ForeignKey(GpuHost, on_delete=models.CASCADE, related_name="engine_groups")
    deployment = models.ForeignKey(
        Deployment, on_delete=models.PROTECT, related_name="engine_groups"
    )
    index = models.PositiveSmallIntegerField()
    first_gpu = models.PositiveSmallIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["host_id", "index"]
        constraints = [
            models.UniqueConstraint(fields=["host", "index"], name="engine_group_index_unique"),
            models.UniqueConstraint(
                fields=["host", "first_gpu"], name="engine_group_first_gpu_unique"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.host_id}#{self.index}"

    @property
    def tensor_parallel_size(self) -> int:
        return int(self.deployment.tensor_parallel_size)

    @property
    def last_gpu(self) -> int:
        return int(self.first_gpu) + self.tensor_parallel_size - 1

    @property
    def gpu_indices(self) -> list[int]:
        """The host's GPUs this group drives, in rank order."""
        return list(range(int(self.first_gpu), self.last_gpu + 1))

    @property
    def gpu_range(self) -> str:
        """`GPU 2` or `GPUs 0-3`: how errors and pages name the range."""
        if self.tensor_parallel_size == 1:
            return f"GPU {self.first_gpu}"
        return f"GPUs {self.first_gpu}-{self.last_gpu}"
