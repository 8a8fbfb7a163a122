// The broker for the playground suite: the shared launcher, with this suite's names.
import { startBroker as start } from '../../node-common/broker.mjs';

/** A broker on a free loopback port; with a random API key unless `auth: 'none'`. */
export const startBroker = (options = {}) => start({ name: 'playground', ...options });
