"""The two base views. Tenant scoping lives here and only here.

`TenantScopedAPIView` resolves the request's tenant after authentication and permission checks
and refuses the request (403) when there is none: it fails closed. Subclasses reach data only
through `self.tenant`, passed to the selectors. They may not override the methods that resolve
it or choose who may call (`__init_subclass__` raises), so no subclass can bypass the scope.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from rest_framework import exceptions
from rest_framework.authentication import SessionAuthentication
from rest_framework.negotiation import BaseContentNegotiation
from rest_framework.parsers import BaseParser
from rest_framework.renderers import BaseRenderer, BrowsableAPIRenderer, JSONRenderer
from rest_framework.request import Request
from rest_framework.utils.mediatypes import media_type_matches
from rest_framework.views import APIView

from api.authentication import ApiKeyAuthentication
from api.models import Tenant
from api.permissions import IsOperator, IsTenantUser, request_tenant
from gpu_runtime.contract.request_id import bind_log_context

_SEALED = (
    "dispatch",
    "initial",
    "tenant",
    "get_queryset",
    "get_object",
    "get_authenticators",
    "get_permissions",
    "check_permissions",
    "check_object_permissions",
    "authentication_classes",
    "permission_classes",
    "perform_authentication",
)


class IgnoreAcceptNegotiation(BaseContentNegotiation):
    """Answer with the view's first renderer whatever `Accept` says, as OpenAI's API does.

    (The `openai` client asks for `application/binary` when it downloads file content; an error
    must still come back as the JSON error body, not as a 406.)
    """

    def select_parser(self, request: Request, parsers: Iterable[BaseParser]) -> BaseParser | None:
        content_type = request.content_type
        for parser in parsers:
            if media_type_matches(parser.media_type, content_type):
                return parser
        return None

    def select_renderer(
        self,
        request: Request,
        renderers: Iterable[BaseRenderer],
        format_suffix: str | None = None,
    ) -> tuple[BaseRenderer, str]:
        renderer = next(iter(renderers))
        return renderer, renderer.media_type


class TenantScopedAPIView(APIView):
    """Base of every `/v1` view: bearer API key of a tenant user; data of that tenant only."""

    content_negotiation_class = IgnoreAcceptNegotiation
    authentication_classes = [ApiKeyAuthentication]
    permission_classes = [IsTenantUser]
    renderer_classes = [JSONRenderer]
    _tenant: Tenant | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        overridden = [name for name in _SEALED if name in cls.__dict__]
        if overridden:
            raise ImproperlyConfigured(
                f"{cls.__name__} overrides {', '.join(overridden)}; tenant views must take their "
                "data from selectors with self.tenant and may not change how it is resolved."
            )

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)
        tenant = request_tenant(request)
        if tenant is None:
            raise exceptions.PermissionDenied("This endpoint needs a tenant API key.")
        self._tenant = tenant
        bind_log_context(tenant=tenant.name)

    @property
    def tenant(self) -> Tenant:
        """The caller's tenant. Raises (403) if read before `initial` resolved it."""
        if self._tenant is None:
            raise exceptions.PermissionDenied("No tenant resolved for this request.")
        return self._tenant


class OperatorAPIView(APIView):
    """Base of every `/api/ops/` view: an operator, by session or by an operator's API key."""

    authentication_classes = [ApiKeyAuthentication, SessionAuthentication]
    permission_classes = [IsOperator]
    renderer_classes = [JSONRenderer, BrowsableAPIRenderer]
