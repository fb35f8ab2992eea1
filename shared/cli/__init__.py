"""The `kvmesh` command: `up` runs a local stack, `status` shows the router's registry."""
