"""The `kvmesh` command, above the services: `up` runs a local stack (with its own NATS),
`status` shows the router's registry, `trace` a request's spans, `sim` replays a trace. It may
import any service; nothing imports it."""
