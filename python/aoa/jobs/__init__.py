"""Jobs: what aoa does with a mapping and a checkpoint, on top of the compiler, the runtime
and storage.

Each job is "open the source, compile, plan, execute into destinations" (`job.py`); they
differ in where the destination shards come from and where their bytes go:

    convert.py      into a checkpoint folder of a destination format (`aoa convert`)
    load.py         into the caller's arrays and tensors (`aoa.load`)
    distributed.py  either one spread over ranks
"""
