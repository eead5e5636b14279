"""python -m fastload.doctor {env,pipeline}: what stops or starves this run, and the fix.

* pipeline.py  the bottleneck doctor: each stage of the data path timed alone and together;
* charts.py    its waterfall PNG;
* `doctor env` prints the pre-flight check every run does at start (fastload/preflight.py).

The run itself imports nothing from here: the pre-flight check (fastload/preflight.py) and
loader=auto's probe (fastload/autotune.py) sit beside the engine that calls them.
"""
