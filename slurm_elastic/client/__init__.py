"""What workers, the trainer, routers, node agents and the CLI import to talk to a job's controller:
the HTTP client, the wire models the server's routes share, and how to find a controller from its
job id. Nothing here imports the server side (the controller's runtime, the rollout store, the
ASGI server)."""
