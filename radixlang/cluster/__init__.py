"""Several engines behind one endpoint: Ray actors (``replica_set.py``, ``replica.py``) and the
cache-aware router in front of them (``router.py`` over ``prefix_index.py``).

The router and its index are plain Python and import no Ray; only ``replica_set`` and
``replica`` need it (``pip install radixlang[ray]``). Import ``ReplicaSet`` from
``radixlang.cluster.replica_set``.
"""
