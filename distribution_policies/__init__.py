"""Distribution policies, one module each. Every module defines ``POLICY`` (see ``fragflow.placement.registry``)."""
