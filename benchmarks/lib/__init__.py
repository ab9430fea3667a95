"""What the benchmark scripts share, one job per module:

* :mod:`.cli`      the common command line, and the CPU host-device count set before JAX
                   starts;
* :mod:`.meta`     the run metadata written into every JSON, and the JSON itself;
* :mod:`.compiles` XLA compiles counted in every timed pass (a pass that compiled is not a
                   measurement);
* :mod:`.timing`   median and percentile timing, the device's peak FLOP rate, ``is_gpu``;
* :mod:`.trace`    profiler (Chrome trace) parsing and the attribution of device time;
* :mod:`.models`   random-weight models, packed workloads, and reference expert traces;
* :mod:`.tables`   printing a table.

No module here imports JAX at import time: a script parses its arguments, sets the XLA
flags (:func:`.cli.parse_args`) and only then lets JAX start.
"""
