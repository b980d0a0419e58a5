"""zerompi: ZeRO (stages 0-3) over MPI for torch models.

    import zerompi
    engine = zerompi.initialize(model, {"stage": 2, "precision": "bf16"})
    loss = engine(x, y); engine.backward(loss); engine.step()
"""
__version__ = "0.1.0"
