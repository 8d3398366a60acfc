"""Framework integrations, each imported on demand (the frameworks are optional extras):

* :mod:`shardscale.integrations.lightning`: ``ShardscalePrecision``, ``LossScaleMonitor``
  (``pip install shardscale[lightning]``);
* :mod:`shardscale.integrations.accelerate`: ``use_shardscale``, ``scaler_logs``
  (``shardscale[accelerate]``);
* :mod:`shardscale.integrations.transformers`: ``ShardscaleCallback``
  (``shardscale[transformers]``);
* :mod:`shardscale.integrations.torchtitan`: ``to_fp16`` and
  ``--module shardscale.integrations.torchtitan`` (``shardscale[torchtitan]``).
"""
