"""Robot control on persistent sessions: the policy codec (observations and actions as tokens), the simulated
two-link arm with its scripted expert, behaviour-cloning data, and an in-process policy driven through the engine.

`codec`, `arm` and `dataset` need NumPy only (robot-side code imports them without torch); `rollout` uses the engine.
"""
