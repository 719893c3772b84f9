"""The selectors' names in the tables and the plots."""

NAMES = {"fullkv": "FullKV (dense)", "locks": "LOCKS", "oracle": "exact-LSE oracle", "quest": "Quest",
         "centroid": "page centroid", "shared_sequence": "shared basis / sequence (ShadowKV-style)",
         "shared_global": "shared basis / global (Loki-style)", "locks:host": "LOCKS, tier host"}
