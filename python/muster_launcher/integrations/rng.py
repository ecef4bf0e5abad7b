"""A rank's random number generators, as a snapshot takes and gives them back: Python's, NumPy's
(when NumPy is imported), torch's CPU generator, and every CUDA device's once CUDA is in use."""

import random
import sys


def states():
    import torch

    taken = {"python": random.getstate(), "cpu": torch.random.get_rng_state()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        taken["numpy"] = numpy.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        taken["cuda"] = torch.cuda.random.get_rng_state_all()
    return taken


def set_states(taken):
    import torch

    random.setstate(taken["python"])
    torch.random.set_rng_state(taken["cpu"])
    numpy = sys.modules.get("numpy")
    if numpy is not None and "numpy" in taken:
        numpy.random.set_state(taken["numpy"])
    if "cuda" in taken and torch.cuda.is_available():
        torch.cuda.random.set_rng_state_all(taken["cuda"])
