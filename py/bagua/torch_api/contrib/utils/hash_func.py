"""The shard hash of ``ClusterStore``: CRC-16/XMODEM (polynomial 0x1021,
initial value 0), the checksum Redis Cluster uses for key slots."""

__all__ = ["crc16"]


def _table():
    table = []
    for byte in range(256):
        crc = byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else (crc << 1)
        table.append(crc & 0xFFFF)
    return table


_TABLE = _table()


def crc16(key) -> int:
    """CRC-16/XMODEM of ``key`` (str, encoded as UTF-8, or bytes)."""
    data = key.encode() if isinstance(key, str) else bytes(key)
    crc = 0
    for byte in data:
        crc = ((crc << 8) & 0xFFFF) ^ _TABLE[((crc >> 8) ^ byte) & 0xFF]
    return crc
