"""Cluster-scale goodput: a seeded discrete-event Monte Carlo fed with the costs our benchmarks measured.

``unbroken simulate-cluster`` projects what cannot be run here (thousands of
workers failing every few hours) from component costs measured here:
:mod:`~unbroken.cluster.costs` reads them from benchmark JSON files,
:mod:`~unbroken.cluster.scaling` scales them to a target model,
:mod:`~unbroken.cluster.failures` draws failures, :mod:`~unbroken.cluster.degraded`
gives the slowdown of a degraded step per takeover policy,
:mod:`~unbroken.cluster.strategies` plays each recovery strategy over the same
failures and :mod:`~unbroken.cluster.montecarlo` repeats it over seeds.

The replica engine (``--replica-size``, ``--validate``) takes replicas as the
unit of failure: :mod:`~unbroken.cluster.phases` reads the recovery phases,
each with its source, :mod:`~unbroken.cluster.replicas` the job, its failure
taxonomy and spare pool, :mod:`~unbroken.cluster.engine` plays a strategy
over the failures, :mod:`~unbroken.cluster.projection` repeats it over seeds
and :mod:`~unbroken.cluster.validate` replays real runs and published
results through the same engine.
"""

from unbroken.cluster.costs import Figure, load_costs
from unbroken.cluster.engine import EngineCosts, run_engine
from unbroken.cluster.failures import Event, FailureSpec, generate_events
from unbroken.cluster.montecarlo import SimOptions, run_monte_carlo
from unbroken.cluster.phases import Input, load_inputs
from unbroken.cluster.replicas import ReplicaSpec, replica_events
from unbroken.cluster.scaling import SimCosts, TargetHardware, scale_costs
from unbroken.cluster.strategies import Strategy, daly_interval_s, simulate_strategy, young_interval_s

__all__ = [
    "EngineCosts", "Event", "FailureSpec", "Figure", "Input", "ReplicaSpec", "SimCosts", "SimOptions", "Strategy",
    "TargetHardware", "daly_interval_s", "generate_events", "load_costs", "load_inputs", "replica_events",
    "run_engine", "run_monte_carlo", "scale_costs", "simulate_strategy", "young_interval_s",
]
