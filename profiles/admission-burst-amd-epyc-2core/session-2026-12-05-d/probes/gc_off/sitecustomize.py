# PYTHONPATH=<this folder>: GC off in the engine core process (after its gc.freeze(); nothing else calls it).
import gc

_freeze = gc.freeze
def freeze():
    _freeze(); gc.disable()
gc.freeze = freeze
