"""The assembly: what the lifespan (app/resources.py) builds, by concern. upstream.py puts
together every model call's path from the calling stages and the deployments; services.py
the database, Redis, limits and intake parts; gauges.py binds metrics to the typed objects
they read; closing.py bounds every close on the way out."""
