"""How a host's inference server authenticates requests.

By default a request needs the gateway's grant (`x-harli-grant`, verified with the host's key
and name: `gpu_runtime.server.GatewayGrants`); the gateway has already authenticated the tenant,
and the grant names the models the request may call. With `--allow-tenant-keys` a request that
carries no grant may still present its tenant's API key, checked against the control plane
(`agent.auth.KeyVerifier`), the way before the gateway. A host with neither refuses every
inference request; `/health` needs nothing.
"""

from __future__ import annotations

import logging

from gpu_runtime.agent.auth import KeyVerifier
from gpu_runtime.agent.config import HOST_KEY_ENV, AgentConfig
from gpu_runtime.server import BearerKeys, GatewayGrants

logger = logging.getLogger(__name__)


def host_auth(config: AgentConfig) -> GatewayGrants:
    """The `RequestAuth` of the agent's server for `config` (what it will accept is logged)."""
    tenant_keys = None
    if config.allow_tenant_keys:
        tenant_keys = BearerKeys(KeyVerifier(config.control_url, ttl_s=config.key_cache_ttl_s))
        logger.warning(
            "host %s accepts tenants' API keys on requests without a grant, checked against %s "
            "(--allow-tenant-keys)",
            config.host,
            config.control_url,
        )
    if config.host_key is None:
        if tenant_keys is None:
            logger.error(
                "host %s has no host key (--host-key-file or %s) and takes no tenant keys "
                "(--allow-tenant-keys): every inference request will be refused (401)",
                config.host,
                HOST_KEY_ENV,
            )
        else:
            logger.warning("host %s has no host key: every grant will be refused", config.host)
    return GatewayGrants(host=config.host, key=config.host_key, tenant_keys=tenant_keys)
