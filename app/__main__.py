from app.cli import main

# Guarded: vLLM's engine core starts with multiprocessing's spawn, which re-imports the main module.
if __name__ == "__main__":
    raise SystemExit(main())
