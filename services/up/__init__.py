"""`lockstep up`: serve a model on this machine with one command (see __main__.py).

__main__.py (flags, signals, exit status) → run.py (start the services, deploy, watch,
stop in order), with settings.py, model.py (which model, tp/pp, sampling defaults),
preflight.py (busy ports, a live supervisor), admin.py (the supervisor's admin socket),
replicas.py (--replicas N), progress.py and console.py (what the terminal shows).
"""
