def main() -> None:
    print("client")
