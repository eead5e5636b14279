"""python -m fastload.doctor {env,pipeline}: what stops or starves this run, and the fix.

* env.py       the pre-flight check (every run does it at start; `doctor env` prints it);
* pipeline.py  the bottleneck doctor: each stage of the data path timed alone and together;
* charts.py    its waterfall PNG;
* autotune.py  loader=auto: a bounded probe of workers / prefetch / pinning / backends at the
               start of a run, cached per (machine, dataset, config).
"""
