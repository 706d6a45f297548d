"""libemsa seen from Python: the declared ctypes table (library, structs) and the objects that
own library handles (arenas, the host tier, DLPack views, plans, the profile cache, the CPU
load used while probing). Everything above reaches the library through this layer or the
engines; nothing here imports the rest of emsa.
"""
