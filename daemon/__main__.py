def main() -> None:
    print("daemon")
