"""The layer one call goes through: ``Pipeline`` (load a bundle once, then generate or stream), the engines a
bundle opens and the lease by which calls share them (``engines``), one call's resumable steps
(``generation``), text, stops and ``Stream`` (``streaming``), the store of earlier contexts (``prompt_cache``)
and the step costs ``auto`` measures (``step_costs``). ``from specdec_edge import Pipeline`` is the short way in.
"""
