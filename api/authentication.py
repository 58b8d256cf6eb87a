"""Bearer API-key authentication (`Authorization: Bearer hk-...`)."""

from __future__ import annotations

from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.request import Request

from api.models import ApiKey, User
from api.services.apikeys import api_key_authenticate


class ApiKeyAuthentication(BaseAuthentication):
    """Authenticate `Authorization: Bearer <key>`; no header means "not this scheme" (None).

    A present but wrong, malformed or revoked key is a 401, never a fall-through to other schemes.
    """

    keyword = b"bearer"

    def authenticate(self, request: Request) -> tuple[User, ApiKey] | None:
        header = get_authorization_header(request).split()
        if not header or header[0].lower() != self.keyword:
            return None
        if len(header) != 2:
            raise exceptions.AuthenticationFailed(
                "Malformed Authorization header; expected 'Bearer <API key>'.",
                code="invalid_api_key",
            )
        try:
            key = header[1].decode("ascii")
        except UnicodeDecodeError:
            raise exceptions.AuthenticationFailed(
                "Incorrect API key provided.", code="invalid_api_key"
            ) from None
        api_key = api_key_authenticate(key=key)
        if api_key is None:
            shown = key[:7] + "..." if len(key) > 7 else key
            raise exceptions.AuthenticationFailed(
                f"Incorrect API key provided: {shown}.", code="invalid_api_key"
            )
        return api_key.user, api_key

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="harli"'
