"""ControlNet-as-a-Service (Katz §5): ControlNets beside the base UNet, cached and shared.

* :mod:`.models`: the catalog (tiny seeded or a directory), :func:`build_controlnet`,
  :func:`prepare_control_image`;
* :mod:`.cache`: the device-resident LRU/LFU cache with single-flight loads;
* :mod:`.unet_split`: the UNet forward cut where the residuals enter;
* :mod:`.executor`: sessions, the executor interface and the in-process executor;
* :mod:`.predictor`: the ``NoisePredictor`` a worker passes to ``denoise``;
* :mod:`.transport`, :mod:`.service`, :mod:`.client`: the gRPC service and its client;
* :mod:`.metrics`, :mod:`.app`: the ``argus controlnet`` process.
"""
