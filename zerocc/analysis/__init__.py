"""Analyses several passes read; none changes a graph. No pass imports another pass: what two passes share lives here.

    aliasing.py     which nodes return views of an input; a value's storage
    lifetimes.py    every storage's first and last position in the current node order, and its role; the memory plan of them
    live_bytes.py   bytes alive at each position, and the step's live peaks with and without slot releases
    releases.py     which slots the step may drop early, and after which node (release_slots' marks)
    kernels.py      which ops have an ``out=`` overload with a kernel of the device's backend
    arena.py        which buffers place_buffers puts in arenas and which updates it writes in place
    remat.py        what place_remat may recompute, at what cost, and the min-cut plans that choose it
    step_time.py    how long the final program takes on a hardware profile (the cost model)
"""
