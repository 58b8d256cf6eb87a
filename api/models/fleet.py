"""What the operator runs: base models, serving deployments with SLOs, and GPU hosts."""

from __future__ import annotations

from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models

from gpu_runtime.contract.tensor_parallel import MAX_TENSOR_PARALLEL_SIZE

# Base model names appear inside model ids (`ft:<base>:...`), so no ':' and no spaces.
BASE_MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
base_model_name_validator = RegexValidator(
    BASE_MODEL_NAME_PATTERN, "a base model name is 1-64 of A-Z, a-z, 0-9, '.', '_' and '-'"
)


class Architecture(models.TextChoices):
    """The architectures Harli's engine implements; a base model served by vLLM hosts may
    have any other (`BaseModel.architecture`)."""

    LLAMA = "llama", "Llama (Llama 3)"
    QWEN2 = "qwen2", "Qwen2 / Qwen2.5"


class Engine(models.TextChoices):
    """What serves a deployment: Harli's engine (serves and co-locates finetuning) or vLLM
    (serves base models and adapters, trains nothing)."""

    HARLI = "harli", "Harli"
    VLLM = "vllm", "vLLM"


class Dtype(models.TextChoices):
    BFLOAT16 = "bfloat16", "bfloat16"
    FLOAT16 = "float16", "float16"
    FLOAT32 = "float32", "float32"


class BaseModel(models.Model):
    """A foundation model the platform serves and finetunes.

    Weights come from exactly one source (a database constraint): `checkpoint_dir`, a local
    directory of HF safetensors, or `config`, a random-init architecture config (see
    `api.presets`), with `preset` naming the preset it came from, if any.
    """

    name = models.CharField(max_length=64, unique=True, validators=[base_model_name_validator])
    architecture = models.CharField(max_length=64)
    """The config's `model_type` ("llama", "qwen2", "mistral", ...): one of `Architecture`
    for a model Harli's engine serves, any other for one only vLLM hosts serve."""
    checkpoint_dir = models.CharField(max_length=1024, blank=True)
    config = models.JSONField(null=True, blank=True)
    preset = models.CharField(max_length=32, blank=True)
    dtype = models.CharField(max_length=16, choices=Dtype.choices, default=Dtype.BFLOAT16)
    context_length = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                name="base_model_one_weight_source",
                condition=(
                    models.Q(checkpoint_dir="", config__isnull=False)
                    | (~models.Q(checkpoint_dir="") & models.Q(config__isnull=True))
                ),
            )
        ]

    def __str__(self) -> str:
        return self.name


class Deployment(models.Model):
    """A base model served for inference with a latency SLO.

    A decode iteration meets the SLO when its time per output token is at most `tpot_slo_ms`;
    the deployment meets its target when at least `slo_attainment_target_pct` % of them do.
    Each engine group serving it (`EngineGroup`) shards the model over `tensor_parallel_size`
    GPUs of its host; the degree must suit the base model's shape
    (`gpu_runtime.contract.tensor_parallel.tensor_parallel_problem`, checked on create).
    `engine` says which engine's hosts serve it.
    """

    name = models.CharField(max_length=64, unique=True, validators=[base_model_name_validator])
    base_model = models.ForeignKey(BaseModel, on_delete=models.PROTECT, related_name="deployments")
    tpot_slo_ms = models.FloatField(validators=[MinValueValidator(0.001)])
    ttft_slo_ms = models.FloatField(validators=[MinValueValidator(0.001)])
    slo_attainment_target_pct = models.FloatField(
        default=99.0, validators=[MinValueValidator(0.0), MaxValueValidator(100.0)]
    )
    tensor_parallel_size = models.PositiveSmallIntegerField(
        default=1,
        validators=[MinValueValidator(1), MaxValueValidator(MAX_TENSOR_PARALLEL_SIZE)],
    )
    engine = models.CharField(max_length=16, choices=Engine.choices, default=Engine.HARLI)
    """What serves it; a Harli deployment's base model must be of an `Architecture`
    (`api.services.fleet` refuses others on create)."""
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                name="deployment_tensor_parallel_size_range",
                condition=models.Q(
                    tensor_parallel_size__gte=1,
                    tensor_parallel_size__lte=MAX_TENSOR_PARALLEL_SIZE,
                ),
            ),
            models.CheckConstraint(
                name="deployment_slos_positive",
                condition=models.Q(tpot_slo_ms__gt=0, ttft_slo_ms__gt=0),
            ),
            models.CheckConstraint(
                name="deployment_attainment_is_pct",
                condition=models.Q(
                    slo_attainment_target_pct__gte=0, slo_attainment_target_pct__lte=100
                ),
            ),
        ]

    def __str__(self) -> str:
        return self.name


class HostStatus(models.TextChoices):
    ONLINE = "online", "Online"  # heartbeating, accepts new placements
    DRAINING = "draining", "Draining"  # finishes what it has, accepts nothing new
    OFFLINE = "offline", "Offline"  # stopped by the operator
    LOST = "lost", "Lost"  # missed heartbeats; its placements must move


class GpuHost(models.Model):
    """A runtime host: one agent process driving `gpu_count` GPUs of kind `gpu_kind`, each of
    `gpu_memory_bytes`.

    The host consumes the Celery queue `queue_name`. What it serves are its engine groups
    (`engine_groups`, `EngineGroup`): each runs one deployment on a range of its GPUs; finetune
    jobs of a group's base model can be placed on that group. `predictor_version` and
    `predictor_mape` describe the latency predictor the host loaded (null until it reports one).
    """

    name = models.CharField(max_length=64, unique=True, validators=[base_model_name_validator])
    gpu_kind = models.CharField(max_length=64)
    gpu_count = models.PositiveIntegerField(default=1, validators=[MinValueValidator(1)])
    gpu_memory_bytes = models.BigIntegerField(validators=[MinValueValidator(1)])
    status = models.CharField(max_length=16, choices=HostStatus.choices, default=HostStatus.OFFLINE)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    predictor_version = models.CharField(max_length=64, null=True, blank=True)
    predictor_mape = models.FloatField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                name="gpu_host_memory_positive", condition=models.Q(gpu_memory_bytes__gt=0)
            )
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def queue_name(self) -> str:
        """The Celery queue this host's agent consumes."""
        return f"host.{self.name}"
