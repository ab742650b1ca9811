try:
    from quantship.cli.main import main
except KeyboardInterrupt:  # Ctrl-C during the first imports: no traceback either
    raise SystemExit(130) from None

raise SystemExit(main())
