"""The decisions of one pass over a job, one module per policy, the way kubernetes-sigs/jobset keeps one file
per policy: the phase and its transitions, the status conditions, the failure policy (what a failure costs
and the restart budget), the stop condition and the TTL after finishing. Each is a pure function of the spec,
the previous status and what the pass observed; `diloco.operator.job_status.decide` composes them.
"""
