"""The console's views, one module per area; every view derives from `console.access`."""
