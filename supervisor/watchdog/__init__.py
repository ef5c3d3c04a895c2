"""The watchdog: the engine's metrics, GPU and canary turned into signals, the pure policy
and its rules, and the remedies it carries out.
"""
