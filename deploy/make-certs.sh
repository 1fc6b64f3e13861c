#!/usr/bin/env bash
# A development CA and one certificate per role, for pdserve's mutual TLS:
#   deploy/make-certs.sh DIR
# writes DIR/ca.pem (+ ca-key.pem) and, for each of gateway, prefill, decode and client, NAME.pem and NAME-key.pem.
# Each certificate's common name is its role, which is how the services authorise one another (serving/tls.py),
# and it is valid for the DNS names NAME and localhost and the address 127.0.0.1; add names with
# PDSERVE_CERT_SANS="DNS:gateway.example.com,IP:10.0.0.5". For production, use your own CA (cert-manager, ...).
set -euo pipefail
dir=${1:?usage: make-certs.sh DIR}
mkdir -p "$dir"
cd "$dir"
umask 077
curve=(-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes)
openssl req -x509 "${curve[@]}" -keyout ca-key.pem -out ca.pem -days 365 -subj "/CN=pdserve development CA" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
for name in gateway prefill decode client; do
  openssl req "${curve[@]}" -keyout "$name-key.pem" -out "$name.csr" -subj "/CN=$name" 2>/dev/null
  sans="DNS:$name,DNS:localhost,IP:127.0.0.1${PDSERVE_CERT_SANS:+,$PDSERVE_CERT_SANS}"
  printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n' "$sans" > "$name.ext"
  openssl x509 -req -in "$name.csr" -CA ca.pem -CAkey ca-key.pem -CAcreateserial -out "$name.pem" -days 365 \
    -extfile "$name.ext" 2>/dev/null
  rm "$name.csr" "$name.ext"
done
rm -f ca.srl
chmod 644 ./*.pem && chmod 600 ./*-key.pem
echo "certificates in $dir: ca.pem, {gateway,prefill,decode,client}.pem and their -key.pem"
