"""DRF views: one class per operation. Tenant views derive from `TenantScopedAPIView`."""
