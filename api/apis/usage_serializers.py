"""Output shapes of the usage reads: OpenAI's Usage API page (tenant) and plain rows (ops)."""

from __future__ import annotations

from rest_framework import serializers

from api.serializers import list_serializer
from api.usage_selectors import UsageBucket, UsageSum


class UsageCompletionsResultSerializer(serializers.Serializer):
    """OpenAI's `organization.usage.completions.result`. Harli has no projects, users or
    batch calls, and does not group by API key: those fields are always null."""

    object = serializers.SerializerMethodField()
    input_tokens = serializers.IntegerField(source="prompt_tokens")
    output_tokens = serializers.IntegerField(source="completion_tokens")
    num_model_requests = serializers.IntegerField(source="requests")
    model = serializers.CharField(allow_null=True, help_text="when group_by=model")
    project_id = serializers.SerializerMethodField()
    user_id = serializers.SerializerMethodField()
    api_key_id = serializers.SerializerMethodField()
    batch = serializers.SerializerMethodField()

    def get_object(self, result: UsageSum) -> str:
        return "organization.usage.completions.result"

    def get_project_id(self, result: UsageSum) -> str | None:
        return None

    def get_user_id(self, result: UsageSum) -> str | None:
        return None

    def get_api_key_id(self, result: UsageSum) -> str | None:
        return None

    def get_batch(self, result: UsageSum) -> bool | None:
        return None


class UsageBucketSerializer(serializers.Serializer):
    object = serializers.SerializerMethodField()
    start_time = serializers.IntegerField()
    end_time = serializers.IntegerField()
    results = UsageCompletionsResultSerializer(many=True)

    def get_object(self, bucket: UsageBucket) -> str:
        return "bucket"


# Schema of the page: `{"object": "page", "data": [bucket], "has_more", "next_page"}` (built
# with type() because a `data` attribute would shadow Serializer.data).
UsagePageSerializer = type(
    "UsageCompletionsPage",
    (serializers.Serializer,),
    {
        "object": serializers.CharField(default="page"),
        "data": UsageBucketSerializer(many=True),
        "has_more": serializers.BooleanField(),
        "next_page": serializers.CharField(
            allow_null=True, help_text="pass as `page` for the next buckets"
        ),
    },
)


class UsageOpsRowSerializer(serializers.Serializer):
    """One tenant's use of one model in one bucket [start_time, end_time)."""

    start_time = serializers.IntegerField()
    end_time = serializers.SerializerMethodField()
    tenant = serializers.CharField()
    model = serializers.CharField()
    requests = serializers.IntegerField()
    prompt_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()

    def get_end_time(self, row: UsageSum) -> int:
        return row.start_time + int(self.context["bucket_seconds"])


UsageOpsListSerializer = list_serializer(UsageOpsRowSerializer, "UsageOpsList")
