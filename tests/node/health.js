// A gRPC health client in another language than the server: Node's @grpc/grpc-js,
// from the standard grpc.health.v1 .proto alone (what any orchestrator's probe does).
//
//   node health.js HOST:PORT [SERVICE ...]
//
// Prints "SERVICE STATUS" for each service ('' = the whole server; the default) and
// exits 0 only when every one is SERVING; 1 otherwise, with the gRPC error on stderr.
'use strict';

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const [address, ...named] = process.argv.slice(2);
if (!address) {
  console.error('usage: node health.js HOST:PORT [SERVICE ...]');
  process.exit(2);
}
const services = named.length ? named : [''];

const definition = protoLoader.loadSync(path.join(__dirname, 'health.proto'), {
  keepCase: true,
  enums: String,
  defaults: true,
});
const { Health } = grpc.loadPackageDefinition(definition).grpc.health.v1;
const client = new Health(address, grpc.credentials.createInsecure());

function check(service) {
  return new Promise((resolve, reject) => {
    const deadline = new Date(Date.now() + 10000);
    client.Check({ service }, { deadline }, (error, reply) =>
      error ? reject(error) : resolve(reply.status),
    );
  });
}

(async () => {
  let healthy = true;
  for (const service of services) {
    try {
      const status = await check(service);
      console.log(`${JSON.stringify(service)} ${status}`);
      healthy = healthy && status === 'SERVING';
    } catch (error) {
      console.error(`${address} ${JSON.stringify(service)}: ${grpc.status[error.code]}: ${error.details}`);
      healthy = false;
    }
  }
  client.close();
  process.exitCode = healthy ? 0 : 1;
})();
