"""Replicas behind a router (docs/cluster.md): ``replica.py`` is ``inferscale engine`` (one replica,
no front), ``remote.py`` an engine this front does not start (``inferscale serve --engine-url``),
``failover.py`` a request with memory sent again through a replica's death."""
