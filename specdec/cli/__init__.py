"""The ``specdec`` command line.

May import: everything in ``specdec`` and the three services; torch only
inside the commands that run models (``specdec --help`` loads none).
"""
