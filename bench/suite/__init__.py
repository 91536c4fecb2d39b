"""What the sections of ``bench/harness.py`` (``bench/sections``) share: where the bench lives and its
log (``common``), the profiles (``profiles``), one job (``jobs``), two jobs run in turns
(``interleave``), the three systems side by side (``compare``), the limited link (``link``), the report
(``report``) and the results files (``record``)."""
