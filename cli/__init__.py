"""hybridpd's command line (installed as the ``hybridpd_cli`` package). The library never imports it."""
